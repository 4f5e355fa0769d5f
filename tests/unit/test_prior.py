import io

import numpy as np
import pytest

from indexer.ngram_table import NgramTable, NgramTableConfig
from indexer.prior import PriorConfig, StaticPrior

# "1 2 3" is followed by "9 1" and "9 4"; "2" by "3 9" twice and "5" (then the end) once.
TOKS = [1, 2, 3, 9, 1, 2, 3, 9, 4, 2, 5]


def _a(ids):
    return np.array(ids, dtype=np.int32)


def _build(orders, **kw):
    return StaticPrior.build(_a(TOKS), PriorConfig(orders=orders, follower_len=2, **kw))


def _hit(prior, ctx):
    hit = prior.lookup(_a(ctx))
    return None if hit is None else (hit.order, hit.rows.tolist(), hit.count)


def test_backoff_prefers_longest_leader():
    prior = _build((1, 2, 3))
    # "1 2 3" (order 3) occurred twice, so it beats the shorter leaders "2 3" and "3".
    assert _hit(prior, [7, 1, 2, 3]) == (3, [[9, 1], [9, 4]], 2)


def test_backoff_falls_to_shorter_order():
    prior = _build((1, 2, 3))
    # "4 2" was seen once (below min_count 2) so the prior backs off to the leader "2",
    # followed by "3 9" twice and "5" once.
    assert _hit(prior, [7, 4, 2]) == (1, [[3, 9], [5, -1]], 3)


def test_backoff_skips_unknown_middle_order():
    prior = _build((1, 3))
    # Only orders 1 and 3 exist: "1 2" can be answered only by the leader "2".
    assert _hit(prior, [7, 1, 2]) == (1, [[3, 9], [5, -1]], 3)


def test_lookup_miss_returns_none():
    prior = _build((1, 2))
    # Token 8 never occurs, at any order.
    assert prior.lookup(_a([8])) is None
    # An empty context has no leader at all.
    assert prior.lookup(_a([])) is None


def test_order_of_configured_orders_does_not_matter():
    a, b = _build((1, 2)), _build((2, 1))
    # Tables are always consulted longest leader first.
    assert [t.config.leader_len for t in a.tables] == [2, 1]
    assert [t.config.leader_len for t in b.tables] == [2, 1]
    assert _hit(a, [7, 1, 2]) == _hit(b, [7, 1, 2]) == (2, [[3, 9]], 2)


def test_source_tokens_and_nbytes():
    prior = _build((1, 2))
    # The prior remembers how many tokens it was warmed from.
    assert prior.source_tokens == len(TOKS)
    # Its size is the sum of its tables' sizes.
    assert prior.nbytes == sum(t.nbytes for t in prior.tables) > 0


def test_roundtrip_preserves_lookups():
    prior = _build((1, 2, 3))
    again = StaticPrior.from_bytes(prior.to_bytes())
    # Same tables, longest leader first, same source size.
    assert [t.config for t in again.tables] == [t.config for t in prior.tables]
    assert again.source_tokens == prior.source_tokens
    for ctx in ([7, 1, 2, 3], [7, 4, 2], [1, 2], [9], [8], [3, 9, 4]):
        # Every lookup, hit or miss, answers the same after a round trip.
        assert _hit(again, ctx) == _hit(prior, ctx)


def test_roundtrip_with_many_orders_keeps_all_tables():
    prior = StaticPrior.build(_a(TOKS), PriorConfig(orders=tuple(range(1, 13)), follower_len=2, min_count=1))
    again = StaticPrior.from_bytes(prior.to_bytes())
    # Twelve tables (names t0..t11, sorted numerically on load) come back longest first.
    assert [t.config.leader_len for t in again.tables] == list(range(12, 0, -1))


@pytest.mark.parametrize("blob", [b"", b"garbage", bytes(100)])
def test_from_bytes_rejects_garbage(blob):
    # Not an archive at all.
    with pytest.raises(ValueError, match="corrupt"):
        StaticPrior.from_bytes(blob)


def test_from_bytes_rejects_truncation():
    blob = _build((1, 2)).to_bytes()
    for cut in (5, len(blob) // 2, len(blob) - 1):
        # A partially written prior never loads.
        with pytest.raises(ValueError, match="corrupt"):
            StaticPrior.from_bytes(blob[:cut])


def _npz(**arrays):
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def test_from_bytes_rejects_archive_without_tables():
    # A prior with no tables is meaningless.
    with pytest.raises(ValueError, match="no tables"):
        StaticPrior.from_bytes(_npz(source_tokens=np.array([5], np.int64)))


def test_from_bytes_rejects_corrupt_inner_table():
    blob = _npz(source_tokens=np.array([5], np.int64), t0=np.frombuffer(b"not a table", np.uint8))
    # The outer archive is fine but its table is not: still a ValueError.
    with pytest.raises(ValueError, match="corrupt"):
        StaticPrior.from_bytes(blob)


def test_from_bytes_rejects_missing_source_tokens():
    table = _build((1,)).tables[0]
    blob = _npz(t0=np.frombuffer(table.to_bytes(), np.uint8))
    # source_tokens is part of the format.
    with pytest.raises(ValueError, match="corrupt"):
        StaticPrior.from_bytes(blob)


@pytest.mark.parametrize("orders", [(), (0,), (17,), (1, 1), (2, -1)])
def test_prior_config_rejects_bad_orders(orders):
    # Orders are distinct leader lengths in [1, 16], at least one.
    with pytest.raises(ValueError, match="orders"):
        PriorConfig(orders=orders)


def test_prior_config_table_shape():
    cfg = PriorConfig(orders=(2, 4), follower_len=5, top_k=3, min_count=1, max_leaders=10)
    # Each order's table shares the prior's follower shape and limits.
    assert cfg.table(4) == NgramTableConfig(leader_len=4, follower_len=5, top_k=3, min_count=1, max_leaders=10)


def test_prior_config_invalid_table_shape_fails_at_build():
    cfg = PriorConfig(orders=(1,), follower_len=0)
    # follower_len is checked by the table config the prior builds.
    with pytest.raises(ValueError, match="follower_len"):
        StaticPrior.build(_a(TOKS), cfg)


def test_check_vocab_takes_ids_inside_the_vocabulary_and_padding():
    prior = _build((1, 2))
    # The largest follower id is 9; short followers are padded with -1 ("5" then the end).
    prior.check_vocab(10)


def test_check_vocab_refuses_a_follower_at_or_past_the_vocabulary():
    prior = StaticPrior.build(_a([5, 6, 40000, 40001, 7] * 3), PriorConfig(orders=(1, 2), follower_len=4))
    prior.check_vocab(40002)
    # A prior warmed with a bigger tokenizer than a 32000-token namespace's.
    with pytest.raises(ValueError, match="follower id 40001 is outside the vocabulary"):
        prior.check_vocab(32000)
    # The id equal to the vocabulary size is already outside it.
    with pytest.raises(ValueError, match="40001"):
        prior.check_vocab(40001)


def test_check_vocab_refuses_negative_ids_other_than_padding():
    table = _build((1,)).tables[0]
    arrays = table.arrays()
    followers = arrays["followers"].copy()
    followers[0, 0] = -7  # a stored table no tokenizer wrote
    foreign = NgramTable.from_arrays(table.config, {**arrays, "followers": followers})
    with pytest.raises(ValueError, match="follower id -7"):
        StaticPrior((foreign,)).check_vocab(10)
