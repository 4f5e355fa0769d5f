import numpy as np
import pytest

from benchmarks.index_bench import IndexBenchConfig, run_index_bench
from indexer.tokens import SEPARATOR


def _corpus(docs: int, seed: int = 3) -> np.ndarray:
    """Documents of 20-80 ids from a small vocabulary (so they repeat), each ending with a
    separator, as ``warm.tokenize_corpus`` gives them."""
    rng = np.random.default_rng(seed)
    parts = []
    for _ in range(docs):
        parts.append(rng.integers(0, 50, size=int(rng.integers(20, 80))).astype(np.int32))
        parts.append(np.array([SEPARATOR], dtype=np.int32))
    return np.concatenate(parts)


def test_extending_rebuilds_are_timed_beside_sorting_afresh():
    out = run_index_bench(_corpus(400), IndexBenchConfig(buffer_tokens=5000, queries=50, delta_tokens=700, rounds=3))
    # A full buffer took three rounds of 700 new tokens, each rebuilt by extending (the bench
    # refuses a round that sorted afresh), and each timed beside a fresh sort of the same buffer.
    assert out["extend_rounds"] == 3
    timed = ("extend_s_median", "afresh_s_median", "table_build_s_median", "extend_over_afresh_median")
    assert all(out[key] >= 0 for key in timed)
    assert out["buffer_tokens"] <= 5001


def test_rounds_stop_when_the_corpus_runs_out():
    # 100 documents fill the buffer; what is left holds no whole round of 10,000 tokens.
    out = run_index_bench(_corpus(140), IndexBenchConfig(buffer_tokens=5000, queries=10, delta_tokens=10_000))
    assert "extend_rounds" not in out
    with pytest.raises(ValueError, match="delta_tokens"):
        IndexBenchConfig(delta_tokens=0)
