"""Warming a static prior: corpus file -> tokenizer -> frozen n-gram tables.

Formats: ``sharegpt`` (a JSON list of ``{"conversations": [{"from", "value"}]}``, assistant
turns taken), ``jsonl`` (one object per line with a ``text`` field), ``text`` (documents separated
by blank lines). ``.gz`` files are read transparently. Every problem is a ``CorpusError`` naming
the file and what is wrong; nothing is built from a partly read corpus.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np

from indexer.fingerprint import fingerprint_of
from indexer.prior import PriorConfig, StaticPrior
from indexer.tokens import SEPARATOR

logger = logging.getLogger(__name__)

FORMATS = ("sharegpt", "jsonl", "text")
Encoder = Callable[[list[str]], list[list[int]]]


class CorpusError(ValueError):
    """A corpus or tokenizer that cannot be used."""


def load_tokenizer(path: str | Path) -> tuple[Encoder, int]:
    """An encoder for a tokenizer folder or file, and its vocabulary size.

    A SentencePiece ``tokenizer.model`` is used directly (recent transformers versions change
    Llama's leading-space handling); otherwise a Hugging Face ``tokenizer.json``.
    """
    tok = _open_tokenizer(path)
    if hasattr(tok, "id_to_piece"):  # SentencePiece
        sp = tok
        return (lambda texts: sp.encode(texts, num_threads=2)), int(sp.get_piece_size())

    def encode(texts: list[str]) -> list[list[int]]:
        return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]

    return encode, int(tok.get_vocab_size(with_added_tokens=True))


def tokenizer_fingerprint(path: str | Path) -> str:
    """The fingerprint of the tokenizer :func:`load_tokenizer` reads from ``path`` (see
    :mod:`indexer.fingerprint`): the one an engine of that tokenizer states."""
    tok = _open_tokenizer(path)
    if hasattr(tok, "id_to_piece"):  # SentencePiece
        return fingerprint_of(tok.id_to_piece, tok.get_piece_size())
    return fingerprint_of(lambda i: tok.id_to_token(i) or "", tok.get_vocab_size(with_added_tokens=True))


def _open_tokenizer(path: str | Path) -> Any:
    """A SentencePiece processor for a ``tokenizer.model``, else a ``tokenizers.Tokenizer``."""
    path = Path(path)
    model = path / "tokenizer.model" if path.is_dir() else path
    if model.suffix == ".model" and model.exists():
        import sentencepiece as spm

        try:
            return spm.SentencePieceProcessor(model_file=str(model))
        except (OSError, RuntimeError) as exc:
            raise CorpusError(f"{model}: not a SentencePiece model: {exc}") from exc
    spec = path / "tokenizer.json" if path.is_dir() else path
    if not spec.exists():
        raise CorpusError(f"{path}: no tokenizer.model or tokenizer.json found")
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(spec))
    except Exception as exc:  # the Rust side raises its own exception type
        raise CorpusError(f"{spec}: not a tokenizer.json: {exc}") from exc


def read_corpus(path: str | Path, fmt: str, *, every_turn: bool = False) -> Iterator[str]:
    """Documents of a corpus file, in order: of a ShareGPT corpus its assistant turns, or with
    ``every_turn`` all its turns."""
    path = Path(path)
    if fmt not in FORMATS:
        raise CorpusError(f"unknown corpus format {fmt!r}; expected one of {', '.join(FORMATS)}")
    try:
        with _opened(path) as fh:
            if fmt == "sharegpt":
                yield from _sharegpt(json.load(fh), path, every_turn)
            elif fmt == "jsonl":
                for lineno, line in enumerate(fh, 1):
                    if line.strip():
                        yield _jsonl_text(line, f"{path}:{lineno}")
            else:
                yield from (doc.strip() for doc in fh.read().split("\n\n") if doc.strip())
    except _UNREADABLE as exc:
        raise CorpusError(f"{path}: unreadable {fmt} corpus: {exc}") from exc


_UNREADABLE = (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError)


def _opened(path: Path) -> IO[str]:
    """The file as text (gunzipped when its name ends in ``.gz``)."""
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def _sharegpt_turns(data: object, path: Path) -> Iterator[tuple[str, list]]:
    """Each ShareGPT conversation's id and turns, the corpus's shape checked on the way."""
    if not isinstance(data, list):
        raise CorpusError(f"{path}: a sharegpt corpus is a JSON list of conversations")
    for i, conv in enumerate(data):
        turns = conv.get("conversations") if isinstance(conv, dict) else None
        if not isinstance(turns, list):
            raise CorpusError(f"{path}: conversation {i} has no 'conversations' list")
        yield str(conv.get("id", i)), turns


def _sharegpt(data: object, path: Path, every_turn: bool) -> Iterator[str]:
    for _, turns in _sharegpt_turns(data, path):
        for turn in turns:
            if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
                continue
            if every_turn or turn.get("from") == "gpt":
                yield turn["value"]


def sharegpt_dialogues(path: str | Path, *, limit: int) -> list[tuple[str, list[tuple[str, str]]]]:
    """The first ``limit`` ShareGPT conversations with an assistant turn after a prompt: each as
    its id and its non-empty turns, ``("output", text)`` for an assistant turn and ``("input",
    text)`` for any other (load benchmarks replay them as requests nobody has sent before)."""
    path = Path(path)
    try:
        with _opened(path) as fh:
            data = json.load(fh)
    except _UNREADABLE as exc:
        raise CorpusError(f"{path}: unreadable sharegpt corpus: {exc}") from exc
    picked: list[tuple[str, list[tuple[str, str]]]] = []
    for cid, turns in _sharegpt_turns(data, path):
        kept = [
            ("output" if t.get("from") == "gpt" else "input", t["value"])
            for t in turns
            if isinstance(t, dict) and isinstance(t.get("value"), str) and t["value"].strip()
        ]
        if any(kind == "output" for kind, _ in kept[1:]):
            picked.append((cid, kept))
        if len(picked) >= limit:
            break
    return picked


def split_documents(tokens: np.ndarray) -> list[np.ndarray]:
    """A tokenized corpus (documents each followed by a separator) cut back into its documents."""
    cuts = np.flatnonzero(tokens == SEPARATOR)
    starts = np.concatenate(([0], cuts[:-1] + 1))
    return [tokens[a:b] for a, b in zip(starts.tolist(), cuts.tolist(), strict=True) if b > a]


def checked_ids(ids: list[int], vocab_size: int) -> np.ndarray:
    """A tokenizer's ids as an int64 array, every one inside the vocabulary."""
    arr = np.asarray(ids, dtype=np.int64)
    if arr.size and (arr.min() < 0 or arr.max() >= vocab_size):
        raise CorpusError(f"tokenizer produced ids outside [0, {vocab_size})")
    return arr


def _jsonl_text(line: str, where: str) -> str:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise CorpusError(f"{where}: invalid JSON: {exc}") from exc
    if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
        raise CorpusError(f"{where}: expected an object with a 'text' string")
    return obj["text"]


def tokenize_corpus(
    docs: Iterator[str],
    encode: Encoder,
    vocab_size: int,
    *,
    batch: int = 2048,
    progress: Callable[[int, int], None] | None = None,
    source: str = "the corpus",
) -> np.ndarray:
    """All documents as one int32 array, each followed by the request separator. A corpus
    without a single token is refused (``source`` names it): its prior would be empty."""
    chunks: list[np.ndarray] = []
    n_docs = n_tokens = 0
    pending: list[str] = []

    def flush() -> None:
        nonlocal n_docs, n_tokens
        for ids in encode(pending):
            arr = checked_ids(ids, vocab_size)
            chunks.append(np.append(arr, SEPARATOR).astype(np.int32))
            n_tokens += arr.size
        n_docs += len(pending)
        pending.clear()
        if progress is not None:
            progress(n_docs, n_tokens)

    for doc in docs:
        pending.append(doc)
        if len(pending) >= batch:
            flush()
    if pending:
        flush()
    if not chunks:
        raise CorpusError(f"{source} holds no documents")
    if n_tokens == 0:
        raise CorpusError(f"{source} holds no text: its {n_docs} documents are all empty")
    return np.concatenate(chunks)


def corpus_writer(tokens: np.ndarray) -> bytes:
    """The 16-byte writer id a tokenized corpus appends to a lifetime log under (its documents
    are that writer's commits 0, 1, ...): the same corpus and tokenizer give the same id, so the
    log takes each document once however often the append is run.

    >>> corpus_writer(np.array([5, 6, -1], np.int32)) == corpus_writer(np.array([5, 6, -1], np.int32))
    True
    """
    return hashlib.blake2b(np.ascontiguousarray(tokens, np.int32).tobytes(), digest_size=16).digest()


def build_prior(tokens: np.ndarray, config: PriorConfig) -> StaticPrior:
    logger.info("building prior tables %s over %d tokens", config.orders, tokens.size)
    return StaticPrior.build(tokens, config)
