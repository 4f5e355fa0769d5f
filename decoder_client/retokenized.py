"""A draft model with a tokenizer of its own, drafting in the target's ids (the idea of
transformers' universal assisted generation): a small model of one family beside the cache of a
target of another.

Each step the target's context is turned into bytes (every token's bytes, exactly, from either
kind of tokenizer this module reads: byte-level BPE, or SentencePiece with byte fallback) and
encoded with the draft model's tokenizer; the model's KV cache keeps what that encoding shares
with the last step's. Where the context's end cuts a draft token in two, the model reads the
cut encoding as it stands. The bytes its chain adds are encoded with the target's tokenizer
behind an anchor of the context's last tokens, from one that starts a word or a line, so the
target's tokenizer splits the anchor as the context did; where the anchor comes back changed the
model abstains (the cache drafts alone). The last target token of a chain that did not end is
dropped: more bytes might have joined it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from decoder_client.chain_model import ChainModel, NextToken
from indexer.tokens import as_tokens

ANCHOR = 64  # most context tokens re-encoded in front of the chain's bytes


def _byte_decoder() -> dict[str, int]:
    """GPT-2's map from byte-level BPE characters back to bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def token_bytes(tokenizer: Any) -> list[bytes]:
    """Every id's bytes in text (special and added tokens: none). Byte-level BPE (pieces such as
    ``Ġworld``) and SentencePiece with byte fallback (``▁world``, ``<0x0A>``) are read exactly;
    another kind is refused.

    >>> from transformers import AutoTokenizer  # doctest: +SKIP
    >>> token_bytes(AutoTokenizer.from_pretrained("llama2-spm"))[13]  # doctest: +SKIP
    b'\\n'
    """
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoding = str(getattr(backend, "decoder", ""))
    byte_level = decoding.startswith("ByteLevel")
    spm = 'Replace(pattern=String("▁")' in decoding and "ByteFallback" in decoding
    if not (byte_level or spm):
        raise ValueError("token_bytes reads byte-level BPE or SentencePiece (byte fallback) tokenizers only")
    decoder = _byte_decoder() if byte_level else {}
    out: list[bytes] = []
    for i, piece in enumerate(pieces):
        if piece is None or i in special:
            out.append(b"")
        elif byte_level:
            out.append(bytes(decoder[c] for c in piece) if all(c in decoder for c in piece) else piece.encode())
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            out.append(bytes([int(piece[3:5], 16)]))
        else:
            out.append(piece.replace("▁", " ").encode())
    return out


def _adds_prefix_space(tokenizer: Any, table: list[bytes]) -> bool:
    """Whether the tokenizer puts a space before the text it encodes (SentencePiece's dummy
    prefix): then an anchor that starts with a space is encoded without it."""
    ids = tokenizer.encode("a", add_special_tokens=False)
    return b"".join(table[i] for i in ids).startswith(b" ")


class Retokenized:
    """``inner`` (a :class:`ChainModel` over the draft tokenizer's ids) drafting chains of at
    most ``k`` of the target's ids. :meth:`first` gives the draft model's first token (in its own
    ids) and its probability, or ``None`` where it abstains; :meth:`extend` the chain in the
    target's ids, each with its chance given the one before (empty where it abstains).

    >>> small = Retokenized(ModelDrafter(smollm2, 9), llama2_tokenizer, smollm2_tokenizer, 8)  # doctest: +SKIP
    >>> BesideCache(cache_drafter, small)  # doctest: +SKIP
    """

    def __init__(self, inner: ChainModel, target_tokenizer: Any, draft_tokenizer: Any, k: int) -> None:
        self.inner = inner
        self.k = k
        self.target_tokenizer = target_tokenizer
        self.draft_tokenizer = draft_tokenizer
        self._target_bytes = token_bytes(target_tokenizer)
        self._draft_bytes = token_bytes(draft_tokenizer)
        self.vocab_size = len(self._target_bytes)
        if inner.vocab_size < len(self._draft_bytes):
            raise ValueError(
                f"the draft model reads {inner.vocab_size} ids; its tokenizer has {len(self._draft_bytes)}"
            )
        self._prefix_space = _adds_prefix_space(target_tokenizer, self._target_bytes)
        # The context, and the bytes the chain must spell first (the draft encoding of a context
        # whose bytes are not whole characters may leave some out).
        self._pending: tuple[np.ndarray, bytes] | None = None
        self.abstained = 0  # steps the model sat out: its first token or the re-encoding did not fit

    @property
    def target_bytes(self) -> list[bytes]:
        """Each target id's bytes."""
        return self._target_bytes

    @property
    def draft_bytes(self) -> list[bytes]:
        """Each draft id's bytes."""
        return self._draft_bytes

    @property
    def pending_tail(self) -> bytes | None:
        """The context's last bytes that the draft encoding left out, which the chain's first
        token spells first; ``None`` where :meth:`first` gave no token to extend."""
        return None if self._pending is None else self._pending[1]

    def first(self, context: np.ndarray) -> NextToken | None:
        ctx = as_tokens(context, self.vocab_size, what="context")
        self._pending = None
        text = b"".join(self._target_bytes[i] for i in ctx.tolist())
        ids = self.draft_tokenizer.encode(text.decode("utf-8", "replace"), add_special_tokens=False)
        spelled = b"".join(self._draft_bytes[i] for i in ids)
        if not ids or not text.startswith(spelled):
            self.abstained += 1
            return None
        nxt = self.inner.first(np.asarray(ids, dtype=np.int32))
        tail = text[len(spelled) :]
        first = b"" if nxt is None else self._draft_bytes[nxt.token]
        if nxt is None or not first or not (first.startswith(tail) or tail.startswith(first)):
            self.abstained += 1
            return None
        self._pending = (ctx, tail)
        return nxt

    def extend(self, min_prob: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        if self._pending is None:
            raise RuntimeError("no next token to extend: call first() with a context it drafts for")
        ctx, tail = self._pending
        self._pending = None
        tokens, probs = self.inner.extend(min_prob)  # a target token's chance is the reach of its last draft token
        pieces = [self._draft_bytes[t] for t in tokens.tolist()]
        ended = b"" in pieces  # an end of text (or another special token): the chain stops there
        if ended:
            pieces = pieces[: pieces.index(b"")]
        spelled = b"".join(pieces)
        if not spelled.startswith(tail):
            return self._abstain()
        chain, ends = self._encode(ctx, spelled[len(tail) :])
        if chain is None:
            return self._abstain()
        if not ended:
            chain, ends = chain[:-1], ends[:-1]
        chain, ends = chain[: self.k], ends[: self.k]
        if not chain.size:
            return self._abstain()
        # Each target token's chance: the draft's chance of reaching the token that finishes it.
        draft_ends = np.cumsum([len(p) for p in pieces]) - len(tail)
        reach = np.cumprod(probs[: len(pieces)].astype(np.float64))
        at = np.minimum(np.searchsorted(draft_ends, ends), reach.size - 1)
        r = reach[at]
        return chain, (r / np.concatenate(([1.0], r[:-1]))).astype(np.float32)

    def _encode(self, ctx: np.ndarray, added: bytes) -> tuple[np.ndarray | None, np.ndarray]:
        """``added`` in the target's ids behind an anchor of the context's last tokens, and where
        each of those ids ends in ``added``; no ids where the anchor comes back changed."""
        anchor = ctx[self._anchor_start(ctx) :]
        text = b"".join(self._target_bytes[i] for i in anchor.tolist())
        if self._prefix_space and text.startswith(b" "):
            text = text[1:]
        ids = self.target_tokenizer.encode((text + added).decode("utf-8", "replace"), add_special_tokens=False)
        n = anchor.size
        if self._prefix_space and ids[1 : n + 1] == anchor.tolist() and self._target_bytes[ids[0]] == b" ":
            ids = ids[1:]  # the prefix space before an anchor that starts a line
        if ids[:n] != anchor.tolist():
            return None, np.zeros(0, dtype=np.int64)
        chain = np.asarray(ids[n:], dtype=np.int32)
        ends = np.cumsum([len(self._target_bytes[i]) for i in chain.tolist()]).astype(np.int64)
        return chain, ends

    def _anchor_start(self, ctx: np.ndarray) -> int:
        """The latest of the context's last :data:`ANCHOR` tokens that starts a word or a line:
        from there the target's tokenizer splits the text as it did in the context."""
        table = self._target_bytes
        for i in range(ctx.size - 1, max(0, ctx.size - ANCHOR) - 1, -1):
            if table[int(ctx[i])].startswith(b" ") or (i > 0 and table[int(ctx[i - 1])].endswith(b"\n")):
                return i
        return max(0, ctx.size - ANCHOR)

    def _abstain(self) -> tuple[np.ndarray, np.ndarray]:
        self.abstained += 1
        return np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.float32)
