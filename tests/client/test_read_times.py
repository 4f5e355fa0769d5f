"""What a draft model's reads take, as the beside rule prices them: a token of a prompt timed
apart from a token of a step's catch-up, a row's share of a batch's read, and the models of one
engine timed together."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import pytest

from decoder_client.chain_model import CATCH_UP, ChainModel, ReadTimes, extend_many, first_many

VOCAB = 16
FORWARD_S = 0.02  # what a forward takes here, whatever it reads


class Timed(ChainModel):
    """A model whose forwards take :data:`FORWARD_S` however many rows and tokens they read
    (as a small model's do on a device that is not full), all rows read in one."""

    def _feed(self, ids: np.ndarray) -> np.ndarray:
        return self._feed_many([self], [ids])[0]

    @classmethod
    def _feed_many(cls, models: Sequence[ChainModel], feeds: Sequence[np.ndarray]) -> list[np.ndarray]:
        time.sleep(FORWARD_S)
        return [np.eye(VOCAB)[(int(ids[-1]) + 1) % VOCAB] for ids in feeds]

    def _rewind(self, n: int) -> None:
        pass


def _ids(n: int, start: int = 0) -> np.ndarray:
    return ((np.arange(n) + start) % VOCAB).astype(np.int32)


def test_a_rows_reads_are_its_share_of_the_batchs_and_a_prompt_is_timed_apart() -> None:
    shared = ReadTimes()
    rows = [Timed(k=4, vocab_size=VOCAB, max_positions=None) for _ in range(4)]
    for m in rows:
        m.times = shared
    prompt = 2 * CATCH_UP
    first_many(rows, [_ids(prompt, r) for r in range(4)])  # four prompts in one forward
    assert shared.catch_up is None and shared.prompt is not None
    assert shared.prompt == pytest.approx(FORWARD_S / (4 * prompt), rel=0.5)
    extend_many(rows)  # three reads of a token each, the four rows in one forward each
    assert shared.read == pytest.approx(FORWARD_S / 4, rel=0.5)
    # Each row's two new tokens: the target took none of the chain, and a token of its own.
    first_many(rows, [np.append(_ids(prompt, r), _ids(2, prompt + r + 5)) for r in range(4)])
    assert shared.catch_up == pytest.approx(FORWARD_S / 8, rel=0.5)
    assert all(m.read_seconds == shared.read and m.prompt_seconds == shared.prompt for m in rows)
    # A prompt among the rows makes the forward a prompt's: a step's catch-up is not timed by it.
    catch_up = shared.catch_up
    rows[0].reset()
    first_many(rows, [np.append(_ids(prompt, r), _ids(3, prompt + r + 7)) for r in range(4)])
    assert shared.catch_up == catch_up


def test_a_model_alone_pays_its_whole_read_and_keeps_its_own_times() -> None:
    alone, other = (Timed(k=4, vocab_size=VOCAB, max_positions=None) for _ in range(2))
    alone.first(_ids(3))
    extend_many([alone])
    assert alone.read_seconds == pytest.approx(FORWARD_S, rel=0.5)
    assert alone.catch_up_seconds == pytest.approx(FORWARD_S / 3, rel=0.5)
    assert other.times == ReadTimes()  # models not given one engine's times are timed apart
