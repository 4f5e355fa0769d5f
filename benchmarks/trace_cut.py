"""A draft model in replay that stops reading once its chain has left the trace.

A chain is accepted up to its first wrong token, so whatever the model drafts after that token
is never accepted, only counted. Replay knows each request's output, so once a chain's latest
token is off the trace the model's further reads in that chain are skipped: each gives the token
just read as certain (the chain repeats it to its full length) and leaves the model's cache
alone. Most of a live model's forwards in replay are such reads (a chain of 8 is accepted for
about two tokens), and what is accepted does not change:

- in the model's own ids the chains are the uncut model's up to and including their first wrong
  token, so the same tokens are accepted and the same steps taken;
- behind another tokenizer (:class:`decoder_client.retokenized.Retokenized`) the chain's bytes
  are re-encoded in the target's ids, and the target's tokenizer splits a word by all of its
  bytes: the model reads on past the first wrong byte until the word holding it has ended (a
  space or a newline), so every target id before the wrong one, and the re-encoding's check of
  its anchor, come out as the uncut model's. Only the ids after the wrong one differ.

What is no longer a decoder's is the draft time, the scores of a chain's tokens past the cut,
and (behind another tokenizer) how many ids the repeated tail re-encodes to.
``replay --cut-off-trace`` is for long runs of MAT, not for timing. For the same reason a
position is read once per run, whichever of the model's drafters reaches it first; the second
then compares chances from forwards made along the first one's path, and a near tie may go the
other way (0.2% of the mix's MAT on 26 Spec-Bench conversations, docs/MEASUREMENTS.md).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np

from decoder_client.chain_model import ChainModel, ChainSource, NextToken
from decoder_client.retokenized import Retokenized


class SkipsOffTrace(ChainModel):
    """``inner``'s reads, except where :attr:`worth_reading` says a chain's next read can change
    nothing accepted: from the first token it turns down until the chain ends, reads are skipped
    (see the module)."""

    def __init__(self, inner: ChainModel) -> None:
        super().__init__(inner.k, inner.vocab_size, inner.max_positions)
        self.inner = inner
        self.worth_reading: Callable[[int], bool] | None = None  # set for one chain by :class:`TraceCut`
        self.off = False  # the chain being extended reads no more
        self.skipped = 0  # reads skipped
        self.late = 0  # skipped ids read after all, by a context that went on with them
        self._read = 0  # ids the inner model's cache holds

    def _feed(self, ids: np.ndarray) -> np.ndarray:
        if self.worth_reading is not None:  # a chain's next read
            if self.off or not self.worth_reading(int(ids[-1])):
                self.off = True
                self.skipped += 1
                p = np.zeros(self.vocab_size)
                p[int(ids[-1])] = 1.0
                return p
            before = self._held.size  # the chain's ids join it after the read
        else:  # a context's: it may go on with a cut chain's skipped ids, past a request's end
            before = self._held.size - ids.size
            owed = self._held[self._read : before]
            self.late += int(owed.size)
            ids = np.concatenate([owed, ids]) if owed.size else ids
            self.off = False
            before -= int(owed.size)
        if self._read != before:
            raise RuntimeError(f"a read after {before} ids where the model's cache holds {self._read}")
        probs = self.inner._feed(ids)
        self._read += int(ids.size)
        return probs

    def _rewind(self, n: int) -> None:
        # A chain's skipped ids are wrong, so a later context of the same request diverges at the
        # first of them at the latest. Past a request's end they were only off its text: the next
        # request's context may go on with them, and then they are read with its new ids.
        self.off = False
        self._read = min(n, self._read)
        self.inner._rewind(self._read)


class TraceCut:
    """``source`` (a :class:`ChainSource` over ``model``, itself or behind another tokenizer)
    drafting for requests whose whole ids :meth:`reveal` gives: each chain's reads stop once it
    has left them. Contexts must be prefixes of what was revealed, as replay's are.

    A position read once is not read again: what :meth:`first` and :meth:`extend` gave there is
    kept, by the request's ids and the context's length. The model alone and the model beside ours
    walk the same requests, in step wherever the mix proposes the model's chain, so the second
    replay reads little the first did not."""

    def __init__(self, source: ChainSource, model: SkipsOffTrace) -> None:
        self.source = source
        self.model = model
        self.k = source.k
        self.vocab_size = source.vocab_size
        self._truth = np.zeros(0, dtype=np.int32)
        self._truth_bytes = b""
        self._byte_ends = np.zeros(0, dtype=np.int64)
        self._request = b""  # a digest of the revealed ids
        self._at = 0  # the context's length at the last first()
        self._fresh = False  # the source read that context itself (its chain can be extended)
        self._firsts: dict[tuple[bytes, int], NextToken | None] = {}
        self._chains: dict[tuple[bytes, int, float], tuple[np.ndarray, np.ndarray]] = {}
        self.remembered = 0  # answers given from what was read before

    def reveal(self, ids: np.ndarray) -> None:
        """The request's whole ids: its prompt, then its output."""
        self._truth = np.asarray(ids, dtype=np.int32)
        self._request = hashlib.blake2b(self._truth.tobytes(), digest_size=16).digest()
        if isinstance(self.source, Retokenized):
            table = self.source.target_bytes
            pieces = [table[i] for i in self._truth.tolist()]
            self._truth_bytes = b"".join(pieces)
            self._byte_ends = np.cumsum([len(p) for p in pieces], dtype=np.int64)

    def first(self, context: np.ndarray) -> NextToken | None:
        n = int(np.asarray(context).size)
        if n > self._truth.size or not np.array_equal(context, self._truth[:n]):
            raise ValueError("the context is not a prefix of the request revealed")
        self._at = n
        key = (self._request, n)
        if key in self._firsts:
            self.remembered += 1
            self._fresh = False
            return self._firsts[key]
        self._firsts[key] = nxt = self.source.first(context)
        self._fresh = True
        return nxt

    def extend(self, min_prob: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        key = (self._request, self._at, min_prob)
        if key in self._chains:
            self.remembered += 1
            self._fresh = False
            tokens, probs = self._chains[key]
            return tokens.copy(), probs.copy()
        if not self._fresh and self.source.first(self._truth[: self._at]) is None:
            raise RuntimeError("no next token to extend: call first() with a context it drafts for")
        self._fresh = False
        self.model.worth_reading = self._worth_reading()
        try:
            tokens, probs = self.source.extend(min_prob)
        finally:
            self.model.worth_reading = None
        self._chains[key] = (tokens.copy(), probs.copy())
        return tokens, probs

    def _worth_reading(self) -> Callable[[int], bool]:
        """Whether each token the model reads next in this chain, in turn, can still change what is
        accepted: in the same ids, while the chain follows the trace; behind another tokenizer, until
        the word that leaves it has ended."""
        if not isinstance(self.source, Retokenized):
            expected = self._truth[self._at :].tolist()
            depth = 0

            def same_id(token: int) -> bool:
                nonlocal depth
                depth += 1
                return depth <= len(expected) and token == expected[depth - 1]

            return same_id
        tail = self.source.pending_tail
        if tail is None:
            raise RuntimeError("no next token to extend: call first() with a context it drafts for")
        table = self.source.draft_bytes
        at = int(self._byte_ends[self._at - 1]) - len(tail) if self._at else 0
        expected = self._truth_bytes[at:]
        spelled = b""
        differs = -1  # the first byte of the chain's that is not the trace's, once there is one

        def word_not_ended(token: int) -> bool:
            # Read on past the first wrong byte until the word holding it ends: the target's
            # tokenizer splits a word by all of it, and the chain's tokens up to there are the
            # whole model's. After a space or a newline nothing read changes what is accepted.
            nonlocal spelled, differs
            piece = table[token]
            if not piece:  # a special token: the chain ends here whatever follows
                return False
            spelled += piece
            if differs < 0 and expected.startswith(spelled):
                return True
            if differs < 0:
                n = min(len(spelled), len(expected))
                wrong = np.flatnonzero(np.frombuffer(spelled[:n], np.uint8) != np.frombuffer(expected[:n], np.uint8))
                differs = int(wrong[0]) if wrong.size else n
            rest = spelled[max(differs, len(spelled) - len(piece)) :]
            return b" " not in rest and b"\n" not in rest

        return word_not_ended
