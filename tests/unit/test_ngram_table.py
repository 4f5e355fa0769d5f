import io
import itertools
import zipfile

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from indexer.ngram_table import NgramTable, NgramTableConfig, leader_hash, leader_hashes
from indexer.tokens import SEPARATOR

S = int(SEPARATOR)


def _a(ids):
    return np.array(ids, dtype=np.int32)


def _cfg(**kw):
    return NgramTableConfig(**kw)


# Probabilities may be stored at reduced precision (float16): compare to within 1e-3.
TOL = 1e-3


def _lookup(table, leader):
    """``(rows, probs rounded to 3 decimals, count)`` as plain lists, or None."""
    hit = table.lookup(_a(leader))
    if hit is None:
        return None
    rows, probs, count = hit
    return rows.tolist(), np.round(probs.astype(np.float64), 3).tolist(), count


def _probs(table, leader):
    return table.lookup(_a(leader))[1].astype(np.float64)


# The doctest text: "1 2" is followed by "3 4" twice and "3 5" once.
DOC = [1, 2, 3, 4, 9, 1, 2, 3, 4, 9, 1, 2, 3, 5]


# -- config --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        {"leader_len": 0},
        {"follower_len": 0},
        {"top_k": 0},
        {"min_count": 0},
        {"max_leaders": 0},
        {"leader_len": 17},
        {"follower_len": 65},
    ],
)
def test_config_validation(kw):
    # Every size is >= 1 and leaders/followers have hard upper bounds.
    with pytest.raises(ValueError):
        NgramTableConfig(**kw)


def test_leader_hash_matches_vectorised_hashes():
    mat = _a([[1, 2, 3], [0, 0, 0], [2**31 - 2, 5, 7]])
    # The scalar hash used by lookups equals the vectorised one used by build.
    assert leader_hashes(mat).tolist() == [leader_hash(row) for row in mat]
    # Order matters: "1 2" and "2 1" are different leaders.
    assert leader_hash(_a([1, 2])) != leader_hash(_a([2, 1]))
    # So does length: "0" and "0 0" differ.
    assert leader_hash(_a([0])) != leader_hash(_a([0, 0]))


# -- literal builds --------------------------------------------------------------------------


def test_build_literal_followers_probs_and_count():
    table = NgramTable.build(_a(DOC), _cfg(leader_len=2, follower_len=2, top_k=2))
    rows, _, count = _lookup(table, [7, 1, 2])
    # "1 2" occurred 3 times, each followed by at least one token.
    assert count == 3
    # "3 4" (seen twice) outscores "3 5" (seen once).
    assert rows == [[3, 4], [3, 5]]
    # P("3") = 3/3; P("3 4") = 2/3; P("3 5") = 1/3.
    np.testing.assert_allclose(_probs(table, [1, 2]), [[1.0, 2 / 3], [1.0, 1 / 3]], atol=TOL)


def test_build_literal_follower_cut_by_end_of_text():
    table = NgramTable.build(_a(DOC), _cfg(leader_len=2, follower_len=2, top_k=2))
    rows, _, count = _lookup(table, [2, 3])
    # "2 3" is followed by "4 9" twice and by "5" then the end of the text once.
    assert count == 3
    # The short follower is padded with -1 and its missing position has probability 0.
    assert rows == [[4, 9], [5, -1]]
    np.testing.assert_allclose(_probs(table, [2, 3]), [[2 / 3, 2 / 3], [1 / 3, 0.0]], atol=TOL)


def test_top_k_keeps_best_followers():
    table = NgramTable.build(_a(DOC), _cfg(leader_len=2, follower_len=2, top_k=1))
    rows, _, count = _lookup(table, [1, 2])
    # Only the most likely follower survives; the leader count still covers all occurrences.
    assert rows == [[3, 4]]
    np.testing.assert_allclose(_probs(table, [1, 2]), [[1.0, 2 / 3]], atol=TOL)
    assert count == 3


def test_min_count_drops_rare_leaders():
    table = NgramTable.build(_a(DOC), _cfg(leader_len=2, follower_len=2, min_count=3))
    # "1 2" and "2 3" occur 3 times each and are kept.
    assert _lookup(table, [1, 2]) is not None
    assert _lookup(table, [2, 3]) is not None
    # "3 4" occurs only twice: below min_count.
    assert _lookup(table, [3, 4]) is None
    # So exactly the two frequent leaders remain.
    assert table.leaders == 2


def test_default_min_count_two_drops_singletons():
    table = NgramTable.build(_a(DOC), _cfg(leader_len=2, follower_len=2))
    # "3 4" was seen twice: kept at the default min_count of 2.
    assert _lookup(table, [3, 4])[2] == 2
    # "3 5" was seen once and is followed by nothing: never a leader.
    assert _lookup(table, [3, 5]) is None


def test_max_leaders_keeps_most_frequent():
    table = NgramTable.build(_a(DOC), _cfg(leader_len=2, follower_len=2, max_leaders=1))
    # "1 2" and "2 3" tie at 3 occurrences; the tie goes to the smaller leader "1 2".
    assert _lookup(table, [1, 2])[2] == 3
    assert _lookup(table, [2, 3]) is None
    assert table.leaders == 1


def test_max_leaders_prefers_count_over_order():
    # "5" occurs 3 times (followed each time), "1" only twice.
    text = [1, 9, 1, 9, 5, 8, 5, 8, 5, 8]
    table = NgramTable.build(_a(text), _cfg(leader_len=1, follower_len=1, max_leaders=1))
    # The most frequent leader wins even though "1" is lexicographically smaller.
    assert _lookup(table, [5]) == ([[8]], [[1.0]], 3)
    assert _lookup(table, [1]) is None


def test_leaders_and_followers_never_cross_separator():
    text = [1, 2, 5, S, 2, 3, 6, S, 1, 2, 5, S, 2, 3, 6, S]
    table = NgramTable.build(_a(text), _cfg(leader_len=2, follower_len=3, min_count=1))
    # "1 2" is followed by "5" and then a separator: the follower stops there.
    assert _lookup(table, [1, 2]) == ([[5, -1, -1]], [[1.0, 0.0, 0.0]], 2)
    # "2 5" is only ever followed by a separator, so it leads nothing.
    assert _lookup(table, [2, 5]) is None
    # "5 2" exists only across a separator.
    assert _lookup(table, [5, 2]) is None
    # Exactly the two leaders with clean followers: "1 2" and "2 3".
    assert table.leaders == 2


def test_leader_occurrence_followed_by_separator_is_not_counted():
    text = [1, 2, S, 1, 3, S, 1, 3, S]
    table = NgramTable.build(_a(text), _cfg(leader_len=1, follower_len=1, min_count=1))
    # "1" occurs 3 times, each followed by a real token: "3" twice, "2" once.
    assert _lookup(table, [1]) == ([[3], [2]], [[0.667], [0.333]], 3)
    # "2" and "3" are only ever followed by a separator: never leaders.
    assert table.lookup(_a([2])) is None
    assert table.lookup(_a([3])) is None


def test_leader_count_skips_occurrences_followed_by_separator_or_end():
    text = [1, 3, S, 1, 3, S, 1, S, 1]
    table = NgramTable.build(_a(text), _cfg(leader_len=1, follower_len=1, min_count=1))
    # "1" occurs 4 times but only twice with a follower (then S, then the end of the text), so
    # the count is 2 and P("3") = 2/2.
    assert _lookup(table, [1]) == ([[3]], [[1.0]], 2)


def test_unknown_leader_and_short_context():
    table = NgramTable.build(_a(DOC), _cfg(leader_len=2, follower_len=2))
    # Leader never seen.
    assert table.lookup(_a([8, 8])) is None
    # A context shorter than the leader cannot be looked up.
    assert table.lookup(_a([2])) is None


def test_empty_text_builds_empty_table():
    table = NgramTable.build(_a([]), _cfg(leader_len=1, follower_len=2))
    # No tokens: no leaders, no entries, lookups miss.
    assert (table.leaders, table.entries) == (0, 0)
    assert table.lookup(_a([1])) is None


def test_text_of_only_separators_builds_empty_table():
    table = NgramTable.build(_a([S, S, S]), _cfg(leader_len=1, follower_len=2, min_count=1))
    # A separator is never a leader.
    assert table.leaders == 0


def test_large_table_lookups():
    # Thousands of leaders (lookups binary-search the sorted leader hashes).
    r = np.arange(5000, dtype=np.int32)
    table = NgramTable.build(np.concatenate((r, r)), _cfg(leader_len=1, follower_len=1, min_count=2))
    # Every t < 4999 is followed by t + 1 twice; 4999 once (then the end) and is dropped.
    assert table.leaders == 4999
    for t in (0, 1, 2048, 4097, 4998):
        assert _lookup(table, [t]) == ([[t + 1]], [[1.0]], 2)
    assert table.lookup(_a([4999])) is None
    assert table.lookup(_a([7000])) is None
    # The same answers survive a round trip.
    again = NgramTable.from_bytes(table.to_bytes())
    assert _lookup(again, [4097]) == ([[4098]], [[1.0]], 2)


def test_rows_of_lookup_have_follower_len_columns_and_int32():
    table = NgramTable.build(_a(DOC), _cfg(leader_len=2, follower_len=5, top_k=4))
    rows, probs, _ = table.lookup(_a([1, 2]))
    # Rows and probabilities always span follower_len columns.
    assert rows.shape[1] == 5 and probs.shape == rows.shape
    assert rows.dtype == np.int32


def test_end_of_text_acts_like_a_separator():
    cfg = _cfg(leader_len=2, follower_len=2, top_k=4, min_count=1)
    plain = NgramTable.build(_a([1, 2, 3, 4, 9, 1, 2, 3]), cfg)
    terminated = NgramTable.build(_a([1, 2, 3, 4, 9, 1, 2, 3, S]), cfg)
    # The text's end cuts a follower exactly as a separator does, so the tables agree.
    assert _lookup(plain, [1, 2]) == _lookup(terminated, [1, 2])
    # And the truncated "3" merges into "3 4": one row.
    assert _lookup(plain, [1, 2])[0] == [[3, 4]]


# -- serialisation ---------------------------------------------------------------------------


def test_roundtrip_preserves_lookups():
    table = NgramTable.build(_a(DOC), _cfg(leader_len=2, follower_len=3, top_k=3, min_count=1))
    again = NgramTable.from_bytes(table.to_bytes())
    # Config and sizes survive.
    assert again.config == table.config
    assert (again.leaders, again.entries) == (table.leaders, table.entries)
    # Every leader answers identically (including misses).
    for leader in itertools.product([1, 2, 3, 4, 5, 9], repeat=2):
        assert _lookup(again, list(leader)) == _lookup(table, list(leader))


def test_roundtrip_of_empty_table():
    table = NgramTable.build(_a([]), _cfg(leader_len=2, follower_len=3))
    again = NgramTable.from_bytes(table.to_bytes())
    # Still empty and still the same shape.
    assert again.leaders == 0
    assert again.config == table.config


@pytest.mark.parametrize("blob", [b"", b"not a table", bytes(range(256)) * 4])
def test_from_bytes_rejects_garbage(blob):
    # Anything that is not our .npz is refused with ValueError.
    with pytest.raises(ValueError, match="corrupt"):
        NgramTable.from_bytes(blob)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=300))
def test_from_bytes_random_bytes_raise_value_error(blob):
    # Random input never escapes as another exception type.
    with pytest.raises(ValueError):
        NgramTable.from_bytes(blob)


def test_from_bytes_rejects_truncation():
    blob = NgramTable.build(_a(DOC), _cfg(leader_len=2, follower_len=2)).to_bytes()
    for cut in (1, 10, len(blob) // 3, len(blob) // 2, len(blob) - 1):
        # A partially written blob is corrupt.
        with pytest.raises(ValueError, match="corrupt"):
            NgramTable.from_bytes(blob[:cut])


def test_from_bytes_detects_flipped_payload_bytes():
    blob = NgramTable.build(_a(DOC), _cfg(leader_len=2, follower_len=2)).to_bytes()
    with zipfile.ZipFile(io.BytesIO(blob)) as zf:
        infos = zf.infolist()
    for info in infos:
        start = info.header_offset
        name_len = int.from_bytes(blob[start + 26 : start + 28], "little")
        extra_len = int.from_bytes(blob[start + 28 : start + 30], "little")
        data = start + 30 + name_len + extra_len
        for pos in (data, data + info.compress_size // 2, data + info.compress_size - 1):
            bad = bytearray(blob)
            bad[pos] ^= 0xFF
            # Every array member is CRC-checked, so a flipped payload byte cannot load silently.
            with pytest.raises(ValueError, match="corrupt"):
                NgramTable.from_bytes(bytes(bad))


def _npz(**arrays):
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def test_from_bytes_rejects_missing_member():
    blob = _npz(shape=np.array([2, 2, 4, 2, 8], np.int64))
    # A well-formed archive without the table arrays is not a table.
    with pytest.raises(ValueError, match="corrupt"):
        NgramTable.from_bytes(blob)


def test_from_bytes_rejects_inconsistent_arrays():
    good = {
        "shape": np.array([2, 2, 4, 2, 8], np.int64),
        "keys": np.array([5], np.uint64),
        "offsets": np.array([0, 1], np.int64),
        "leader_counts": np.array([3], np.int64),
        "followers": np.array([[1, 2]], np.int32),
        "probs": np.array([[1.0, 0.5]], np.float16),
    }
    # The consistent set loads.
    assert NgramTable.from_bytes(_npz(**good)).entries == 1
    for name, bad in [
        ("offsets", np.array([0, 1, 1], np.int64)),  # one offset too many
        ("followers", np.array([[1, 2, 3]], np.int32)),  # wider than follower_len
        ("followers", np.array([[1, 2]], np.int64)),  # wrong dtype
        ("keys", np.array([5], np.int64)),  # keys must be uint64 hashes
        ("probs", np.array([[1.0, 0.5], [1.0, 0.5]], np.float16)),  # shape differs from followers
    ]:
        # Each mismatch means the blob is not a table we wrote.
        with pytest.raises(ValueError, match="corrupt"):
            NgramTable.from_bytes(_npz(**{**good, name: bad}))
    # An invalid stored config is refused too (leader_len 0).
    with pytest.raises(ValueError, match="corrupt"):
        NgramTable.from_bytes(_npz(**{**good, "shape": np.array([0, 2, 4, 2, 8], np.int64)}))


def test_from_bytes_rejects_leader_counts_of_wrong_length():
    table = NgramTable.build(_a(DOC), _cfg(leader_len=2, follower_len=2))
    with np.load(io.BytesIO(table.to_bytes())) as z:
        arrays = {name: z[name] for name in z.files}
    arrays["leader_counts"] = np.zeros(0, np.int64)
    # One count per leader is part of the format; a blob without them is corrupt.
    with pytest.raises(ValueError, match="corrupt"):
        NgramTable.from_bytes(_npz(**arrays)).lookup(_a([1, 2]))


# -- property tests --------------------------------------------------------------------------


def _count(text, pattern):
    m = len(pattern)
    return sum(text[i : i + m] == pattern for i in range(len(text) - m + 1))


def _clean_continuations(text, leader, fl):
    """Follower of every occurrence of ``leader``: up to ``fl`` tokens, cut at a separator or
    the end; empty ones (leader followed by a separator or the end) are skipped."""
    ll = len(leader)
    out = []
    for i in range(len(text) - ll + 1):
        if text[i : i + ll] != leader:
            continue
        f = []
        for tok in text[i + ll : i + ll + fl]:
            if tok == S:
                break
            f.append(tok)
        if f:
            out.append(tuple(f))
    return out


def _score(text, leader, follower):
    return sum(_count(text, leader + list(follower[: j + 1])) for j in range(len(follower)))


table_texts = st.lists(st.sampled_from([0, 1, 2, S]), max_size=40)
table_configs = st.builds(
    NgramTableConfig,
    leader_len=st.integers(1, 3),
    follower_len=st.integers(1, 4),
    top_k=st.integers(1, 4),
    min_count=st.integers(1, 3),
)


@settings(max_examples=150, deadline=None)
@given(text=table_texts, cfg=table_configs)
def test_table_matches_brute_force(text, cfg):
    table = NgramTable.build(_a(text), cfg)
    ll, fl = cfg.leader_len, cfg.follower_len
    present = 0
    for leader in map(list, itertools.product([0, 1, 2], repeat=ll)):
        conts = _clean_continuations(text, leader, fl)
        hit = table.lookup(_a(leader))
        # A leader is kept iff it occurs, followed by a real token, at least min_count times.
        if len(conts) < cfg.min_count:
            assert hit is None
            continue
        present += 1
        assert hit is not None
        rows, probs, count = hit
        # The count is the number of occurrences followed by at least one non-separator token.
        assert count == len(conts)
        assert 1 <= rows.shape[0] <= cfg.top_k
        scores = []
        for row, prob in zip(rows.tolist(), probs.tolist(), strict=True):
            f = [t for t in row if t >= 0]
            # Padding only at the end of a row.
            assert row == f + [-1] * (fl - len(f))
            # The follower really followed the leader somewhere (cut at a separator or fl tokens).
            assert any(c[: len(f)] == tuple(f) for c in conts)
            for j in range(fl):
                # probs[r, j] = count(leader + follower[:j+1]) / count(leader); 0 past the row's end.
                expect = _count(text, leader + f[: j + 1]) / count if j < len(f) else 0.0
                assert prob[j] == pytest.approx(expect, abs=TOL)
            scores.append(_score(text, leader, f))
        # Followers come best first by expected accepted length.
        assert scores == sorted(scores, reverse=True)
    # Nothing else is in the table.
    assert table.leaders == present


@settings(max_examples=150, deadline=None)
@given(text=table_texts, cfg=table_configs)
def test_separator_terminated_table_keeps_top_k_distinct_maximal_followers(text, cfg):
    # Lifetime buffers always end with a separator; there the follower set is exactly the
    # maximal continuations (none a prefix of another), best top_k of them.
    text = [*text, S]
    table = NgramTable.build(_a(text), cfg)
    ll, fl = cfg.leader_len, cfg.follower_len
    for leader in map(list, itertools.product([0, 1, 2], repeat=ll)):
        hit = table.lookup(_a(leader))
        if hit is None:
            continue
        conts = set(_clean_continuations(text, leader, fl))
        maximal = {c for c in conts if not any(o != c and o[: len(c)] == c for o in conts)}
        got = [tuple(t for t in row if t >= 0) for row in hit[0].tolist()]
        # No duplicates and no follower that is a prefix of another.
        assert len(set(got)) == len(got)
        assert set(got) <= maximal
        # The kept ones are the top_k by expected accepted length.
        best = sorted((_score(text, leader, c) for c in maximal), reverse=True)[: cfg.top_k]
        assert sorted((_score(text, leader, g) for g in got), reverse=True) == best


def test_every_kept_leader_is_found_including_high_hashes():
    # 3-token leaders over 12 symbols: ~1700 distinct leaders, each seen many times, so all are
    # kept; their 64-bit hashes spread over the whole range, half of them >= 2**63.
    rng = np.random.default_rng(7)
    text = rng.integers(0, 12, size=60_000).astype(np.int32)
    table = NgramTable.build(text, NgramTableConfig(leader_len=3, follower_len=2, max_leaders=1 << 20))
    assert int((table.keys >= np.uint64(1 << 63)).sum()) > table.leaders // 4
    windows = np.lib.stride_tricks.sliding_window_view(text[:-1], 3)
    for leader in np.unique(windows, axis=0)[:500]:
        # A leader that occurred (followed by a token) is always found by its own tokens.
        assert table.lookup(np.ascontiguousarray(leader)) is not None


def _plain_sa_and_lcp(t):
    """Plain lexicographic order reading on past separators, and its LCP (as arrays were once
    sorted): the table must not depend on how rows equal through a separator are ordered."""
    sa = sorted(range(len(t)), key=lambda i: t[i:])
    lcp = [0]
    for a, b in itertools.pairwise(sa):
        k = 0
        while a + k < len(t) and b + k < len(t) and t[a + k] == t[b + k]:
            k += 1
        lcp.append(k)
    return _a(sa), _a(lcp)


@settings(max_examples=150, deadline=None)
@given(text=table_texts, cfg=table_configs)
def test_table_is_the_same_whatever_order_separated_rows_take(text, cfg):
    tokens = _a([*text, S])
    ours = NgramTable.build(tokens, cfg)
    plain = NgramTable.build_from_suffix_array(tokens, *_plain_sa_and_lcp(tokens.tolist()), cfg)
    for name, array in ours.arrays().items():
        assert array.tolist() == plain.arrays()[name].tolist(), name


@settings(max_examples=200, deadline=None)
@given(
    counts=st.lists(st.integers(0, 6), max_size=60),
    max_leaders=st.integers(1, 20),
    min_count=st.integers(1, 3),
)
def test_kept_leaders_are_the_most_frequent_ties_to_the_earlier(counts, max_leaders, min_count):
    lead_count = np.array(counts, dtype=np.int32)
    config = NgramTableConfig(max_leaders=max_leaders, min_count=min_count)
    eligible = [i for i, c in enumerate(counts) if c >= min_count]
    # By count, most first; among equal counts the earlier leader (smaller in SA order) first.
    want = sorted(sorted(eligible, key=lambda i: (-counts[i], i))[:max_leaders])
    assert np.flatnonzero(NgramTable._kept_leaders(lead_count, config)).tolist() == want
