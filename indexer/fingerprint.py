"""A tokenizer's fingerprint: whether two models' ids name the same pieces of text.

A namespace holds one tokenizer's ids, and its size alone cannot tell every pair of tokenizers
apart (Llama-2's and Mistral-7B-v0.1's both have 32,000 ids; see
:func:`indexer.tokens.one_tokenizer`). The fingerprint is a digest of the pieces (the tokenizer's
own strings: ``▁the`` in SentencePiece, ``Ġthe`` in byte-level BPE) of its first
:data:`FINGERPRINT_IDS` ids, in id order. Every loader of one tokenizer lists the same pieces:
SentencePiece's ``id_to_piece``, Hugging Face's ``convert_ids_to_tokens`` and ``tokenizer.json``,
and a GGUF file's token list as llama.cpp reads it. Only the first ids count: what lies past them
differs between loaders of one tokenizer (a GGUF file pads its list to the embedding table with
``[PAD...]`` entries, an engine may add tokens at the end), and two tokenizers that share their
first 16,384 pieces are one tokenizer with tokens added.

>>> a = fingerprint(["<unk>", "<s>", "</s>", "▁the"])
>>> a, fingerprint(["<unk>", "<s>", "</s>", "▁a"]) == a
('183ff1abd2419191', False)
>>> check_fingerprint(a), check_fingerprint("")  # "" is not stated, as old callers send
('183ff1abd2419191', '')
>>> check_fingerprint("not hex")
Traceback (most recent call last):
...
ValueError: a tokenizer fingerprint is 16 lowercase hex digits or empty, got 'not hex'
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Callable, Iterable

# Ids whose pieces make the fingerprint (fewer where the tokenizer has fewer).
FINGERPRINT_IDS = 16384
FINGERPRINT_LENGTH = 16  # hex digits: 64 bits
_FORM = re.compile(r"[0-9a-f]{16}")


def fingerprint(pieces: Iterable[str | bytes]) -> str:
    """The digest of a tokenizer's pieces in id order (the first :data:`FINGERPRINT_IDS` are
    read; more may be given). Each piece is length-prefixed, so no piece's content can pass for
    a boundary."""
    digest = hashlib.sha256(b"draftcache-tokenizer-v1")
    for i, piece in enumerate(pieces):
        if i == FINGERPRINT_IDS:
            break
        raw = piece.encode("utf-8", "surrogatepass") if isinstance(piece, str) else bytes(piece)
        digest.update(struct.pack("<I", len(raw)))
        digest.update(raw)
    return digest.hexdigest()[:FINGERPRINT_LENGTH]


def fingerprint_of(piece: Callable[[int], str | bytes], size: int) -> str:
    """The fingerprint of a tokenizer of ``size`` ids that names id ``i``'s piece ``piece(i)``."""
    return fingerprint(piece(i) for i in range(min(size, FINGERPRINT_IDS)))


def check_fingerprint(value: str) -> str:
    """``value`` if it is a fingerprint or empty (not stated); else ``ValueError``."""
    if not isinstance(value, str) or (value and not _FORM.fullmatch(value)):
        digits = FINGERPRINT_LENGTH
        raise ValueError(f"a tokenizer fingerprint is {digits} lowercase hex digits or empty, got {value!r}")
    return value
