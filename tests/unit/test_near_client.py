"""The near copy on its own (nothing committed anywhere): drafting from each request's context,
the requests it finished and a prior file, and its boundary."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from decoder_client.client.config import ClientConfig
from decoder_client.client.near import NearClient
from decoder_client.client.session import TopkAt
from indexer.drafter import DraftParams
from indexer.prior import PriorConfig, StaticPrior, read_prior

VOCAB = 128
ANSWER = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]


def near(chain: int = 8, prior: StaticPrior | None = None) -> NearClient:
    config = ClientConfig(target="127.0.0.1:1", namespace="n", params=DraftParams(chain=chain))
    return NearClient(config, VOCAB, prior, memory_tokens=1 << 16, commit=False)


def test_a_finished_request_drafts_the_next_one() -> None:
    client = near()
    (first,) = client.open([[1, 2, 3]])
    assert client.draft([first], [ANSWER[:2]])[0].tokens.size == 0  # nothing known yet
    client.add_tokens([first], [ANSWER[2:]])
    client.close([first])
    (second,) = client.open([[7, 1, 2, 3]])
    tree = client.draft([second], [ANSWER[:2]])[0]
    assert tree.tokens.tolist() == ANSWER[2:10]  # the chain: the first answer, K tokens of it
    assert client.stats.near == 2 and client.stats.remote == 0 and client.stats.fallback == 0


def test_the_prior_file_is_read_and_drafted_from(tmp_path: Path) -> None:
    corpus = np.array([9, *ANSWER, 9, *ANSWER, 9], dtype=np.int32)
    path = tmp_path / "prior.npz"
    path.write_bytes(StaticPrior.build(corpus, PriorConfig(orders=(1, 2))).to_bytes())
    client = near(prior=read_prior(path))
    (s,) = client.open([[1, 2, 40, 41]])
    assert client.draft([s], [[]])[0].tokens.tolist()[:4] == [42, 43, 44, 45]
    assert near().draft(near().open([[1, 2, 40, 41]]), [[]])[0].tokens.size == 0  # without it: nothing


def test_a_file_that_is_not_a_prior_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a prior")
    with pytest.raises(ValueError, match="is not a prior file"):
        read_prior(bad)
    with pytest.raises(FileNotFoundError):
        read_prior(tmp_path / "missing.npz")


def test_every_list_is_checked_before_any_session_takes_tokens() -> None:
    client = near()
    a, b = client.open([[1, 2, 3], [4, 5, 6]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        client.draft([a, b], [[7], [VOCAB]])
    assert len(a) == 3 and len(b) == 3  # neither took its tokens
    with pytest.raises(ValueError, match=r"expected dtype int32|must be an int"):
        client.draft([a, b], [np.array([1.0]), []])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="2 sessions, 1 token lists"):
        client.draft([a, b], [[7]])
    with pytest.raises(ValueError, match="prompt: id -1"):
        client.open([[1], [-1]])
    client.draft([a, b], [np.array([7], dtype=np.int64), [8]])  # any integer width, as the draft client takes
    assert len(a) == 4 and len(b) == 4


def test_a_request_closed_without_commit_is_forgotten() -> None:
    client = near()
    (s,) = client.open([[1, 2, 3]])
    client.add_tokens([s], [ANSWER])
    client.close([s], commit=False)
    (again,) = client.open([[1, 2, 3]])
    assert client.draft([again], [ANSWER[:2]])[0].tokens.size == 0
    assert client.drafter.memory.requests == 0


def test_chains_follow_the_cut_asked() -> None:
    client = near()
    (s,) = client.open([[1, 2, 3, 40, 41, 42, 1, 2, 3, 50, 51, 52, 1, 2, 3]])  # two continuations
    assert client.draft([s], [[]])[0].tokens.size > 0
    client.cut_chains_at(0.9)  # neither is that sure
    assert client.draft([s], [[]])[0].tokens.size == 0


def test_lookahead_is_refused() -> None:
    config = ClientConfig(target="127.0.0.1:1", namespace="n", lookahead=2)
    with pytest.raises(ValueError, match="lookahead must be 0"):
        NearClient(config, VOCAB, commit=False)


def test_the_targets_top_k_feeds_the_successor_table_and_is_checked() -> None:
    client = near()
    (s,) = client.open([[1, 2, 3]])
    client.draft([s], [[7]], topk=[[[7, 9]]])
    assert client.drafter.successors.followers_of(3) == [7, 9]
    with pytest.raises(ValueError, match="top-k ids must be integers"):
        client.draft([s], [[8]], topk=[[[8.0, 9.0]]])
    # A row at every verified node, each after its token (40: a node the target rejected).
    client.draft([s], [[8]], topk=[TopkAt([7, 40], [[8, 5], [41, 42]])])
    assert client.drafter.successors.followers_of(40) == [41, 42]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        client.draft([s], [[9]], topk=[TopkAt([VOCAB], [[1]])])
