"""Static priors: frozen n-gram tables of several leader lengths, warmed from a corpus.

Lookups back off from the longest leader to the shortest, so a context that matches a
four-token leader uses the more specific followers and a rare context still gets a guess.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from indexer import kernels
from indexer.ngram_table import NgramTable, NgramTableConfig, lcp_array, with_final_separator
from indexer.suffix_array import build_suffix_array


@dataclass(frozen=True, kw_only=True)
class PriorConfig:
    orders: tuple[int, ...] = (1, 2, 3, 4)
    follower_len: int = 8
    top_k: int = 4
    min_count: int = 2
    max_leaders: int = 1 << 18  # per order: about 170 MB for a 24M-token corpus at the defaults

    def __post_init__(self) -> None:
        if not self.orders or any(o < 1 or o > 16 for o in self.orders):
            raise ValueError(f"orders must be leader lengths in [1, 16], got {self.orders}")
        if len(set(self.orders)) != len(self.orders):
            raise ValueError(f"orders must be distinct, got {self.orders}")

    def table(self, order: int) -> NgramTableConfig:
        return NgramTableConfig(
            leader_len=order,
            follower_len=self.follower_len,
            top_k=self.top_k,
            min_count=self.min_count,
            max_leaders=self.max_leaders,
        )


@dataclass(frozen=True)
class PriorHit:
    order: int
    rows: np.ndarray
    probs: np.ndarray
    count: int


@dataclass(frozen=True)
class StaticPrior:
    """Tables ordered longest leader first.

    >>> toks = np.array([1, 2, 3, 9, 1, 2, 3, 9, 4, 2, 5], dtype=np.int32)
    >>> prior = StaticPrior.build(toks, PriorConfig(orders=(1, 2), follower_len=2))
    >>> hit = prior.lookup(np.array([7, 1, 2], dtype=np.int32))
    >>> hit.order, hit.rows.tolist()  # "1 2" beats "2" alone
    (2, [[3, 9]])
    """

    tables: tuple[NgramTable, ...]
    source_tokens: int = field(default=0)
    # All tables' leader hashes in one sorted array, so one compiled call finds the longest hit.
    _keys: np.ndarray = field(init=False, repr=False, compare=False)
    _owner: np.ndarray = field(init=False, repr=False, compare=False)
    _slot: np.ndarray = field(init=False, repr=False, compare=False)
    _orders: np.ndarray = field(init=False, repr=False, compare=False)
    # All of it as the batch draft step takes it (kernels.prior_args).
    _kernel_args: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if list(self.tables) != sorted(self.tables, key=lambda t: -t.config.leader_len):
            raise ValueError("prior tables must be ordered longest leader first")
        keys = np.concatenate([t.keys for t in self.tables]) if self.tables else np.zeros(0, np.uint64)
        owner = np.concatenate(
            [np.full(t.leaders, i, np.int64) for i, t in enumerate(self.tables)] or [np.zeros(0, np.int64)]
        )
        slot = np.concatenate([np.arange(t.leaders) for t in self.tables] or [np.zeros(0, np.int64)])
        order = np.lexsort((owner, keys))
        object.__setattr__(self, "_keys", keys[order])
        object.__setattr__(self, "_owner", owner[order])
        object.__setattr__(self, "_slot", slot[order])
        object.__setattr__(self, "_orders", np.array([t.config.leader_len for t in self.tables], np.int64))
        self._set_kernel_args()

    def _set_kernel_args(self) -> None:
        tables = [t.search_arrays()[1:] for t in self.tables]
        args = kernels.prior_args(self._orders, self._keys, self._owner, self._slot, tables)
        object.__setattr__(self, "_kernel_args", args)

    @property
    def kernel_args(self) -> tuple:
        """The prior as :func:`~indexer.kernels.draft.draft_batch` takes it (views, no copies)."""
        return self._kernel_args

    @classmethod
    def build(cls, tokens: np.ndarray, config: PriorConfig) -> StaticPrior:
        source = int(tokens.size)
        tokens = with_final_separator(tokens)
        sa = build_suffix_array(tokens)
        lcp = lcp_array(tokens, sa)
        tables = [NgramTable.build_from_suffix_array(tokens, sa, lcp, config.table(o)) for o in config.orders]
        tables.sort(key=lambda t: -t.config.leader_len)
        return cls(tuple(tables), source)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tables)

    def check_vocab(self, vocab_size: int) -> None:
        """``ValueError`` unless every token id the prior can draft is in ``[0, vocab_size)``:
        a prior warmed with another tokenizer is refused, never served.

        >>> toks = np.array([5, 6, 40000, 40001] * 3, dtype=np.int32)
        >>> prior = StaticPrior.build(toks, PriorConfig(orders=(1, 2), follower_len=2))
        >>> prior.check_vocab(50000)
        >>> prior.check_vocab(32000)
        Traceback (most recent call last):
        ...
        ValueError: prior table of leader length 2: follower id 40001 is outside the vocabulary [0, 32000)
        """
        for table in self.tables:
            try:
                table.check_vocab(vocab_size)
            except ValueError as exc:
                raise ValueError(f"prior table of leader length {table.config.leader_len}: {exc}") from None

    def lookup(self, context: np.ndarray) -> PriorHit | None:
        i = kernels.find_longest_leader(context, self._orders, self._keys, self._owner)
        if i < 0:
            return None
        table = self.tables[int(self._owner[i])]
        return PriorHit(table.config.leader_len, *table.entry(int(self._slot[i])))

    def index_arrays(self) -> dict[str, np.ndarray]:
        """The cross-table leader index (derived from the tables; kept to skip rebuilding it)."""
        return {"keys": self._keys, "owner": self._owner, "slot": self._slot}

    @classmethod
    def from_parts(
        cls, tables: tuple[NgramTable, ...], source_tokens: int, index: dict[str, np.ndarray]
    ) -> StaticPrior:
        """A prior over given tables and :meth:`index_arrays` without copying them (so they may
        be memory-mapped); ``ValueError`` when they disagree."""
        keys, owner, slot = index["keys"], index["owner"], index["slot"]
        if list(tables) != sorted(tables, key=lambda t: -t.config.leader_len):
            raise ValueError("prior tables must be ordered longest leader first")
        if not keys.size == owner.size == slot.size == sum(t.leaders for t in tables):
            raise ValueError("the leader index does not match the tables")
        prior = cls.__new__(cls)
        for name, value in (("tables", tables), ("source_tokens", source_tokens), ("_keys", keys),
                            ("_owner", owner), ("_slot", slot)):  # fmt: skip
            object.__setattr__(prior, name, value)
        object.__setattr__(prior, "_orders", np.array([t.config.leader_len for t in tables], np.int64))
        prior._set_kernel_args()
        return prior

    def to_bytes(self) -> bytes:
        buf = io.BytesIO()
        blobs = {f"t{i}": np.frombuffer(t.to_bytes(), dtype=np.uint8) for i, t in enumerate(self.tables)}
        np.savez(buf, source_tokens=np.array([self.source_tokens], np.int64), **blobs)  # type: ignore[arg-type]
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, blob: bytes | bytearray) -> StaticPrior:
        """Inverse of :meth:`to_bytes`; ``ValueError`` on anything corrupt."""
        try:
            with np.load(io.BytesIO(blob), allow_pickle=False) as z:
                names = sorted((k for k in z.files if k.startswith("t")), key=lambda k: int(k[1:]))
                raw = [z[k].tobytes() for k in names]
                source = int(z["source_tokens"][0])
        except Exception as exc:
            raise ValueError(f"corrupt prior blob: {exc}") from exc
        if not raw:
            raise ValueError("corrupt prior blob: no tables")
        tables = sorted((NgramTable.from_bytes(b) for b in raw), key=lambda t: -t.config.leader_len)
        return cls(tuple(tables), source)


def blob_digest(blob: bytes | bytearray | memoryview) -> str:
    """The digest a prior blob (:meth:`StaticPrior.to_bytes`) is stored and checked with:
    blake2b-256, hex (storage keeps it beside the blob; a near copy checks what it read).

    >>> len(blob_digest(b"prior"))
    64
    """
    return hashlib.blake2b(blob, digest_size=32).hexdigest()


def read_prior(path: str | Path) -> StaticPrior:
    """A prior file written by ``draftcache warm --out``; anything else is a clear error (a
    missing file is :class:`FileNotFoundError`, as opening it would say)."""
    try:
        return StaticPrior.from_bytes(Path(path).read_bytes())
    except FileNotFoundError:
        raise
    except (ValueError, KeyError, EOFError, OSError) as exc:  # a directory, a file of something else
        raise ValueError(f"{path} is not a prior file (write one with 'draftcache warm --out'): {exc}") from exc
