"""A draft model's next-token predictions along a trace's outputs: what a small model drafting
beside the cache would propose at every position, made in one teacher-forced pass.

Replay verifies a chain against the trace's tokens, and a chain is only accepted up to its first
wrong token. Up to there, the chain's prefix is the trace's own text, so what a draft model
would predict after it is exactly its prediction at that position of the trace given the text
before it. So one forward pass over each conversation (``draftcache make-draft-rows``) gives,
for every output token, the draft model's top-k ids and log-probabilities, and replay can run
greedy draft-model chains (and chains that mix it with the cache) exactly, without running the
model per step. The pass reads each conversation (inputs and outputs, in order) in windows of
``window`` tokens; each window after the first repeats the ``context`` tokens before it, so every
prediction sees at least that much text (a small model's context is short; an agent's history is
not).

The rows file holds, per conversation, a fingerprint of its segments (so rows are never paired
with another trace's conversations) and, per output segment, ``(n, k)`` ids and log-probs.
"""

from __future__ import annotations

import hashlib
import io
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.traces import Conversation
from cache_service.admin.commands import write_atomic

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SegmentRows:
    """One output segment's predictions: row ``i`` is the draft model's top-k next tokens (most
    likely first) and their log-probabilities given every token before output token ``i``."""

    ids: np.ndarray  # int32 (n, k)
    logp: np.ndarray  # float32 (n, k), <= 0, non-increasing along a row

    def chain(self, pos: int, k: int) -> np.ndarray:
        """The greedy chain of at most ``k`` tokens a draft model proposes at output position
        ``pos`` (the segment's end cuts it), exact up to its first token the trace disagrees with.

        >>> rows = SegmentRows(np.array([[5, 1], [6, 2], [7, 3]], np.int32), np.zeros((3, 2), np.float32))
        >>> rows.chain(1, 8).tolist(), rows.chain(0, 2).tolist()
        ([6, 7], [5, 6])
        """
        return self.ids[pos : pos + k, 0].copy()

    def first_prob(self, pos: int) -> float:
        """How likely the draft model finds its own first token at output position ``pos``."""
        return float(np.exp(self.logp[pos, 0])) if pos < self.logp.shape[0] else 0.0


def fingerprint(conv: Conversation) -> str:
    """A conversation's identity for pairing rows with it: its segments' kinds and tokens.

    >>> from benchmarks.traces import Segment
    >>> a = Conversation("a", "ns", "c", (Segment("input", np.array([1, 2], np.int32)),))
    >>> b = Conversation("b", "ns", "c", (Segment("output", np.array([1, 2], np.int32)),))
    >>> fingerprint(a) == fingerprint(a), fingerprint(a) == fingerprint(b)
    (True, False)
    """
    h = hashlib.blake2b(digest_size=12)
    for seg in conv.segments:
        h.update(seg.kind.encode())
        h.update(np.int64(seg.tokens.size).tobytes())
        h.update(np.ascontiguousarray(seg.tokens, dtype=np.int32).tobytes())
    return h.hexdigest()


def windows(n: int, window: int, context: int) -> list[tuple[int, int, int]]:
    """The passes over a stream of ``n`` tokens: ``(start, end, first)``, each reading
    ``tokens[start:end]`` and keeping its predictions for the tokens at ``first + 1 .. end`` (the
    token at ``first`` is the last one its earlier window predicted), so every position but the
    stream's first is predicted once, from at least ``context`` tokens (all before it, early on).

    >>> windows(10, 4, 1)
    [(0, 4, 0), (3, 7, 4), (6, 10, 7)]
    >>> windows(3, 8, 2)
    [(0, 3, 0)]
    """
    if not 0 <= context < window:
        raise ValueError(f"context must be in [0, window), got {context} and {window}")
    out = []
    start = 0
    while True:
        end = min(start + window, n)
        out.append((start, end, start if start == 0 else start + context))
        if end >= n:
            return out
        start = end - context


def predict_stream(
    model: Any, tokens: np.ndarray, *, k: int, window: int, context: int
) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` ids and log-probs for every token of ``tokens`` given the ones before it (row
    0, which nothing predicts, is ids -1 and log-prob -inf)."""
    import torch

    n = tokens.size
    ids = np.full((n, k), -1, dtype=np.int32)
    logp = np.full((n, k), -np.inf, dtype=np.float32)
    if n < 2:
        return ids, logp
    with torch.inference_mode():
        for start, end, first in windows(n, window, context):
            x = torch.from_numpy(tokens[start:end].astype(np.int64))[None]
            hidden = model.model(x).last_hidden_state[0, first - start :]
            lp = torch.log_softmax(model.lm_head(hidden).float(), dim=-1)
            top = torch.topk(lp, k, dim=-1)
            keep = slice(first + 1, end + 1)  # position p's logits predict token p + 1
            rows = min(end, n - 1) - first  # the stream's last logits predict nothing in it
            ids[keep][:rows] = top.indices[:rows].numpy()
            logp[keep][:rows] = top.values[:rows].numpy()
    return ids, logp


def make_rows(
    model: Any, conversations: Sequence[Conversation], *, k: int = 4, window: int = 4096, context: int = 1024
) -> dict[str, list[SegmentRows]]:
    """Every output segment's rows, per conversation fingerprint."""
    out: dict[str, list[SegmentRows]] = {}
    start, read = time.perf_counter(), 0
    for i, conv in enumerate(conversations):
        stream = np.concatenate([s.tokens for s in conv.segments]) if conv.segments else np.zeros(0, np.int32)
        ids, logp = predict_stream(model, stream, k=k, window=window, context=context)
        segs, at = [], 0
        for s in conv.segments:
            if s.kind == "output":
                segs.append(SegmentRows(ids[at : at + s.tokens.size], logp[at : at + s.tokens.size]))
            at += s.tokens.size
        out[fingerprint(conv)] = segs
        read += stream.size
        rate = read / max(time.perf_counter() - start, 1e-9)
        logger.info("conversation %d of %d: %d tokens (%.0f tokens/s)", i + 1, len(conversations), stream.size, rate)
    return out


def first_guesses_right(rows: dict[str, list[SegmentRows]], conversations: Sequence[Conversation]) -> tuple[int, int]:
    """How many of the conversations' output tokens the model's first guess names, out of how many."""
    right = total = 0
    for conv in conversations:
        outputs = [s for s in conv.segments if s.kind == "output"]
        for seg_rows, seg in zip(rows[fingerprint(conv)], outputs, strict=True):
            right += int((seg_rows.ids[:, 0] == seg.tokens).sum())
            total += seg.tokens.size
    return right, total


def write_rows(path: Path, rows: dict[str, list[SegmentRows]], meta: dict[str, str | int]) -> None:
    """Write ``rows`` to ``path`` (an ``.npz``), whole or not at all."""
    arrays: dict[str, Any] = {f"meta.{key}": np.array(value) for key, value in meta.items()}
    for fp, segs in rows.items():
        arrays[f"{fp}.n"] = np.array(len(segs))
        for i, s in enumerate(segs):
            arrays[f"{fp}.{i}.ids"] = s.ids
            arrays[f"{fp}.{i}.logp"] = s.logp.astype(np.float16)
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    write_atomic(path, buf.getvalue())


class DraftRows:
    """A rows file, read and checked against the conversations it is used with."""

    def __init__(self, path: Path) -> None:
        try:
            with np.load(path, allow_pickle=False) as f:
                self._arrays = {name: f[name] for name in f.files}
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: not a draft rows file ({exc})") from exc
        self.path = path
        self.meta = {n[5:]: self._arrays[n].item() for n in self._arrays if n.startswith("meta.")}
        vocab = self.meta.get("vocab_size")
        if not isinstance(vocab, int) or vocab < 1:
            raise ValueError(f"{path}: no draft model vocabulary size recorded")
        self.vocab_size = vocab  # the draft model's: it may guess ids a trace never holds

    def requests(self, conversations: Sequence[Conversation]) -> list[SegmentRows]:
        """The rows of every output segment of ``conversations``, in replay order. Raises
        ``ValueError`` if the file lacks a conversation or its rows do not fit it."""
        out = []
        for conv in conversations:
            fp = fingerprint(conv)
            if f"{fp}.n" not in self._arrays:
                raise ValueError(f"{self.path}: no rows for conversation {conv.id!r} (made from another trace?)")
            outputs = [s for s in conv.segments if s.kind == "output"]
            if int(self._arrays[f"{fp}.n"]) != len(outputs):
                raise ValueError(
                    f"{self.path}: conversation {conv.id!r} has {len(outputs)} outputs, its rows another count"
                )
            for i, seg in enumerate(outputs):
                out.append(self._checked(fp, i, seg.tokens.size, conv.id))
        return out

    def _checked(self, fp: str, i: int, n: int, conv_id: str) -> SegmentRows:
        ids = self._arrays.get(f"{fp}.{i}.ids")
        logp = self._arrays.get(f"{fp}.{i}.logp")
        where = f"{self.path}: conversation {conv_id!r}, output {i}"
        if ids is None or logp is None:
            raise ValueError(f"{where}: rows missing")
        if ids.ndim != 2 or ids.shape[0] != n or ids.shape != logp.shape or ids.shape[1] < 1:
            raise ValueError(f"{where}: rows of shape {ids.shape} / {logp.shape} for {n} tokens")
        if ids.dtype != np.int32 or ids.min(initial=0) < -1 or ids.max(initial=0) >= self.vocab_size:
            raise ValueError(f"{where}: ids must be int32 in [-1, {self.vocab_size})")
        lp = logp.astype(np.float32)
        if np.isnan(lp).any() or (lp > 0).any():
            raise ValueError(f"{where}: log-probs must be <= 0")
        return SegmentRows(ids, lp)
