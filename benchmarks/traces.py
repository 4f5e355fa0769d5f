"""Reading logged traffic: one JSON conversation per line (see the replay docs in the README)."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cache_service.admin import warm


@dataclass(frozen=True)
class Segment:
    kind: str  # "input" or "output"
    tokens: np.ndarray  # int32


@dataclass(frozen=True)
class Conversation:
    id: str
    namespace: str
    category: str
    segments: tuple[Segment, ...]

    @property
    def output_tokens(self) -> int:
        return sum(s.tokens.size for s in self.segments if s.kind == "output")


def read_traces(path: str | Path, *, limit: int | None = None) -> list[Conversation]:
    """Load a ``.jsonl`` or ``.jsonl.gz`` trace file; ``ValueError`` names the bad line."""
    return list(iter_traces(path, limit=limit))


def iter_traces(path: str | Path, *, limit: int | None = None) -> Iterator[Conversation]:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if limit is not None and lineno > limit:
                    return
                if line.strip():
                    yield _parse(line, f"{path}:{lineno}")
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: unreadable trace file: {exc}") from exc


def write_traces(conversations: Iterable[Conversation], path: str | Path) -> None:
    """A trace file :func:`read_traces` reads back (gzip when the name ends in ``.gz``)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as fh:
        for c in conversations:
            segments = [{"kind": s.kind, "tokens": s.tokens.tolist()} for s in c.segments]
            obj = {"id": c.id, "namespace": c.namespace, "category": c.category, "segments": segments}
            fh.write(json.dumps(obj) + "\n")


def _parse(line: str, where: str) -> Conversation:
    try:
        obj = json.loads(line)
        segments = tuple(_segment(s) for s in obj["segments"])
        return Conversation(
            id=str(obj.get("id", where)),
            namespace=str(obj["namespace"]),
            category=str(obj.get("category", "all")),
            segments=segments,
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{where}: malformed conversation: {exc}") from exc


def _segment(obj: dict) -> Segment:
    kind = obj["kind"]
    if kind not in ("input", "output"):
        raise ValueError(f"segment kind must be 'input' or 'output', got {kind!r}")
    tokens = np.asarray(obj["tokens"], dtype=np.int64)
    if tokens.ndim != 1 or (tokens.size and (tokens.min() < 0 or tokens.max() >= 2**31 - 1)):
        raise ValueError("segment tokens must be a flat list of non-negative int32 ids")
    return Segment(kind, tokens.astype(np.int32))


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
