"""Reading logged traffic: one JSON conversation per line (see the replay docs in the README).

An output segment may carry ``topk``: per output token, the target's top-k next-token ids (at
most :data:`MAX_TOPK`, most likely first) at the position that predicted it, so under greedy
decoding ``topk[i][0] == tokens[i]``. Traces without it read as before.
"""

from __future__ import annotations

import gzip
import json
import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from cache_service.admin import warm

logger = logging.getLogger(__name__)

MAX_TOPK = 8  # most next-token ids per output position a trace may record


@dataclass(frozen=True)
class Segment:
    kind: str  # "input" or "output"
    tokens: np.ndarray  # int32
    # Output segments only, optional: int32 (len(tokens), k), row i the target's top-k next
    # tokens at the position that predicted tokens[i], most likely first.
    topk: np.ndarray | None = None


@dataclass(frozen=True)
class Conversation:
    id: str
    namespace: str
    category: str
    segments: tuple[Segment, ...]

    @property
    def output_tokens(self) -> int:
        return sum(s.tokens.size for s in self.segments if s.kind == "output")

    @property
    def has_topk(self) -> bool:
        """Whether every output segment records the target's top-k."""
        outputs = [s for s in self.segments if s.kind == "output"]
        return bool(outputs) and all(s.topk is not None for s in outputs)

    def largest_id(self) -> int:
        """The largest token id anywhere in the conversation, top-k lists included (-1: none)."""
        arrays = [a for s in self.segments for a in (s.tokens, s.topk) if a is not None and a.size]
        return max((int(a.max()) for a in arrays), default=-1)


def read_traces(path: str | Path, *, limit: int | None = None) -> list[Conversation]:
    """Load a ``.jsonl`` or ``.jsonl.gz`` trace file (the first ``limit`` conversations; blank
    lines are skipped); ``ValueError`` names the bad line."""
    return list(iter_traces(path, limit=limit))


def iter_traces(path: str | Path, *, limit: int | None = None) -> Iterator[Conversation]:
    """:func:`read_traces` one conversation at a time. A request that produced nothing (an
    output segment without tokens: a model that ended at once, its end token not logged) has
    no step to replay and is left out, and so is a conversation left with no request; a
    warning counts them."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    empty = [0, 0]  # output segments without tokens, conversations without a request
    try:
        with opener(path, "rt", encoding="utf-8") as fh:
            read = 0
            for lineno, line in enumerate(fh, 1):
                if limit is not None and read >= limit:
                    return
                if line.strip():
                    conversation, dropped = _parse(line, f"{path}:{lineno}")
                    empty[0] += dropped
                    if conversation is None:
                        empty[1] += 1
                        continue
                    read += 1
                    yield conversation
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: unreadable trace file: {exc}") from exc
    finally:
        if any(empty):
            logger.warning(
                "%s: %d output segments without tokens and %d conversations without a request left out",
                path, *empty,
            )  # fmt: skip


def write_traces(conversations: Iterable[Conversation], path: str | Path) -> None:
    """A trace file :func:`read_traces` reads back (gzip when the name ends in ``.gz``)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as fh:
        for c in conversations:
            segments = [_segment_json(s) for s in c.segments]
            obj = {"id": c.id, "namespace": c.namespace, "category": c.category, "segments": segments}
            fh.write(json.dumps(obj) + "\n")


def check_vocabulary(conversations: Iterable[Conversation], vocab_size: int) -> None:
    """``ValueError`` naming the first conversation with an id (token or top-k) outside
    ``[0, vocab_size)``."""
    for c in conversations:
        largest = c.largest_id()
        if largest >= vocab_size:
            raise ValueError(f"{c.id}: id {largest} is outside the vocabulary [0, {vocab_size})")


def _segment_json(s: Segment) -> dict:
    out: dict = {"kind": s.kind, "tokens": s.tokens.tolist()}
    if s.topk is not None:
        out["topk"] = s.topk.tolist()
    return out


def _parse(line: str, where: str) -> tuple[Conversation | None, int]:
    """The conversation on ``line`` (``None``: no request in it) and how many output segments
    without tokens were left out of it."""
    try:
        obj = json.loads(line)
        if not isinstance(obj, dict) or not isinstance(obj.get("segments"), list):
            raise ValueError("a conversation is an object with a list of segments")
        namespace = str(obj["namespace"])
        parsed = [_segment(s) for s in obj["segments"]]
        segments = tuple(s for s in parsed if s.kind == "input" or s.tokens.size)
        if not any(s.kind == "output" for s in segments):
            return None, len(parsed) - len(segments)
        conversation = Conversation(
            id=str(obj.get("id", where)),
            namespace=namespace,
            category=str(obj.get("category", "all")),
            segments=segments,
        )
        return conversation, len(parsed) - len(segments)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{where}: malformed conversation: {exc}") from exc


def _segment(obj: dict) -> Segment:
    kind = obj["kind"]
    if kind not in ("input", "output"):
        raise ValueError(f"segment kind must be 'input' or 'output', got {kind!r}")
    tokens = np.asarray(_ids(obj["tokens"], "segment tokens"), dtype=np.int64)
    if tokens.ndim != 1 or (tokens.size and (tokens.min() < 0 or tokens.max() >= 2**31 - 1)):
        raise ValueError("segment tokens must be a flat list of non-negative int32 ids")
    if "topk" not in obj:
        return Segment(kind, tokens.astype(np.int32))
    if kind != "output":
        raise ValueError("only output segments carry topk")
    return Segment(kind, tokens.astype(np.int32), checked_topk(obj["topk"], tokens.size))


def _ids(value: object, what: str) -> list:
    """``value`` if it is a list of JSON integers (nested lists of them for top-k rows): numpy
    would otherwise read ``1.7``, ``"12"`` or ``true`` as some id.

    >>> _ids([[1, 2], [3]], "topk")
    [[1, 2], [3]]
    >>> _ids([1, 2.0], "tokens")
    Traceback (most recent call last):
    ...
    ValueError: tokens must be integer ids, got 2.0
    """
    if not isinstance(value, list):
        raise ValueError(f"{what} must be a list of ids, got {type(value).__name__}")
    for item in value:
        if isinstance(item, list):
            _ids(item, what)
        elif type(item) is not int:  # bool is an int subclass: JSON's true is not an id
            raise ValueError(f"{what} must be integer ids, got {item!r}")
    return value


def checked_topk(rows: object, n: int) -> np.ndarray:
    """``rows`` as an int32 ``(n, k)`` array: one row per output token, ``1 <= k <= MAX_TOPK``
    distinct non-negative ids in each.

    >>> checked_topk([[5, 7], [6, 1]], 2).shape
    (2, 2)
    >>> checked_topk([[5, 5]], 1)
    Traceback (most recent call last):
    ...
    ValueError: topk row 0 repeats an id
    """
    if not isinstance(rows, list) or len(rows) != n:
        got = len(rows) if isinstance(rows, list) else type(rows).__name__
        raise ValueError(f"topk must hold one row per output token ({n}), got {got}")
    if n == 0:
        return np.zeros((0, 1), dtype=np.int32)
    _ids(rows, "topk rows")
    try:
        topk = np.asarray(rows, dtype=np.int64)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"topk rows must be equally long lists of ids: {exc}") from exc
    if topk.ndim != 2 or not 1 <= topk.shape[1] <= MAX_TOPK:
        raise ValueError(f"topk rows must hold 1 to {MAX_TOPK} ids each, got shape {topk.shape}")
    if topk.min() < 0 or topk.max() >= 2**31 - 1:
        raise ValueError("topk ids must be non-negative int32 ids")
    ordered = np.sort(topk, axis=1)
    repeats = np.flatnonzero((ordered[:, 1:] == ordered[:, :-1]).any(axis=1))
    if repeats.size:
        raise ValueError(f"topk row {int(repeats[0])} repeats an id")
    return topk.astype(np.int32)


def sharegpt_conversations(
    path: str | Path, encode: Callable[[list[str]], list[list[int]]], vocab_size: int, *, namespace: str, limit: int
) -> list[Conversation]:
    """The first ``limit`` ShareGPT conversations with an assistant turn after a prompt, as
    traces: each turn tokenized on its own, assistant turns as outputs, every other turn as input
    (load benchmarks replay them as requests nobody has sent before)."""
    picked = warm.sharegpt_dialogues(path, limit=limit)
    ids = iter(encode([text for _, kept in picked for _, text in kept]))
    return [
        Conversation(
            id=cid,
            namespace=namespace,
            category="sharegpt",
            segments=tuple(Segment(kind, warm.checked_ids(next(ids), vocab_size).astype(np.int32)) for kind, _ in kept),
        )
        for cid, kept in picked
    ]


def spread(items: list[Any], n: int) -> list[Any]:
    """``n`` items evenly spaced over ``items`` (all of them when there are fewer).

    >>> spread(list(range(10)), 3)
    [0, 3, 6]
    """
    if n >= len(items):
        return list(items)
    return [items[i * len(items) // n] for i in range(n)]
