"""A memory without its own ring adopts indexes built elsewhere over a prefix of a shared log."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.drafter import DrafterConfig, DraftParams, NamespaceDrafter
from indexer.lifetime_buffer import LifetimeBuffer
from indexer.lifetime_index import LifetimeConfig, LifetimeMemory, build_indexes, next_generation
from indexer.tokens import Namespace


def _req(*tokens: int) -> np.ndarray:
    return np.array(tokens, dtype=np.int32)


def _requests(seed: int, n: int, vocab: int = 50) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, vocab, 40).astype(np.int32)
    out = []
    for _ in range(n):  # related requests, as real traffic is: shared stretches, some edits
        r = base.copy()
        r[rng.integers(0, r.size, 4)] = rng.integers(0, vocab, 4)
        out.append(r[: rng.integers(10, r.size)].copy())
    return out


def test_adopted_generation_drafts_exactly_like_a_local_rebuild() -> None:
    config = DrafterConfig()
    requests = _requests(0, 30)
    local = NamespaceDrafter(Namespace(name="t", vocab_size=50), config)
    local.memory.commit_many(requests)
    local.memory.rebuild()
    shared = NamespaceDrafter(Namespace(name="t", vocab_size=50), config, own_ring=False)
    shared.memory.commit_many(requests, [(i, 0) for i in range(len(requests))])
    gen = build_indexes(next_generation(None, requests, config.lifetime.capacity_tokens), config.lifetime.table, 1)
    shared.memory.adopt(gen, (len(requests) - 1, 0))
    assert shared.memory.delta_tokens() == 0
    assert local.memory.indexes is not None
    assert local.memory.indexes.suffix.tokens.tolist() == gen.suffix.tokens.tolist()
    for r in _requests(1, 10):
        ctx = r[:12].tolist()
        a = local.draft(local.open(ctx), DraftParams(budget=16))
        b = shared.draft(shared.open(ctx), DraftParams(budget=16))
        assert a.tokens.tolist() == b.tokens.tolist()
        assert a.parents.tolist() == b.parents.tolist()


def test_adopt_keeps_only_requests_past_the_generation_or_not_yet_logged() -> None:
    mem = LifetimeMemory(LifetimeConfig(capacity_tokens=1000), ring=False)
    mem.commit_many([_req(1, 2), _req(3, 4), _req(5, 6)], [(1, 0), (2, 0), (3, 0)])
    mem.commit(_req(7, 8))  # this process's own commit: its log position is not known yet
    gen = build_indexes(next_generation(None, [_req(1, 2), _req(3, 4)], 1000), LifetimeConfig().table, 1)
    mem.adopt(gen, (2, 0))
    assert mem.delta_tokens() == 6  # [5 6 |] and [7 8 |]
    assert mem.mark_logged(_req(7, 8), (4, 0))
    assert not mem.mark_logged(_req(7, 8), (5, 0))  # already placed: no second copy to mark
    assert not mem.mark_logged(_req(9), (6, 0))
    newer = build_indexes(next_generation(gen.suffix.tokens, [_req(5, 6), _req(7, 8)], 1000), LifetimeConfig().table, 2)
    mem.adopt(newer, (4, 0))
    assert mem.delta_tokens() == 0
    assert mem.buffered_tokens == newer.suffix.size
    assert [idx.longest_match(_req(9, 7), max_len=4)[0] for idx in mem.suffix_indexes()] == [1]


def test_a_ringless_memory_neither_rebuilds_nor_holds_more_than_its_capacity() -> None:
    mem = LifetimeMemory(LifetimeConfig(capacity_tokens=16), ring=False)
    assert mem.buffer is None
    with pytest.raises(RuntimeError):
        mem.rebuild()
    for i in range(20):
        mem.commit(_req(i, i + 1, i + 2))
    assert mem.delta_tokens() <= 16 + 3  # whole requests leave; the oldest kept may straddle the cap
    assert mem.requests == 20
    assert mem.buffered_tokens <= 16
    assert [idx.longest_match(_req(19, 20), max_len=4)[0] for idx in mem.suffix_indexes()] == [2]
    with pytest.raises(RuntimeError):
        LifetimeMemory(LifetimeConfig()).adopt(mem.indexes, (0, 0))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        mem.commit_many([_req(1)], [])


@settings(max_examples=60, deadline=None)
@given(
    cap=st.integers(2, 40),
    requests=st.lists(st.lists(st.integers(0, 9), max_size=30), max_size=12),
    split=st.integers(0, 12),
)
def test_generations_chain_to_what_the_ring_holds(cap: int, requests: list[list[int]], split: int) -> None:
    """Building generation after generation (each from the previous one plus the log's new
    entries) indexes exactly what one ring buffer fed the same log would hold."""
    arrays = [np.array(r, dtype=np.int32) for r in requests]
    ring = LifetimeBuffer(cap)
    for a in arrays:
        ring.append(a)
    first = next_generation(None, arrays[:split], cap)
    chained = next_generation(first if first.size else None, arrays[split:], cap)
    assert chained.tolist() == ring.snapshot().tolist()
