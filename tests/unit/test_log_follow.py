"""Reading the service's log for a near copy (decoder_client.client.follow) against a log that
answers as the service does: pages that stop short of the entry that would overflow them."""

from __future__ import annotations

import numpy as np

from decoder_client.client.follow import LogFollower, OwnCommits, read_recent


class Log:
    """Entries ``1-i`` of ``sizes[i]`` tokens (each filled with ``i``), answered as the service
    answers: a page holds entries up to the tokens asked for (at least one), at most
    ``per_read`` of them."""

    def __init__(self, sizes: list[int], per_read: int) -> None:
        self.entries = [(f"1-{i}", np.full(n, i, dtype=np.int32)) for i, n in enumerate(sizes)]
        self.per_read = per_read
        self.reads = 0

    def __call__(self, after: str, max_tokens: int) -> tuple[list[tuple[str, np.ndarray]], str]:
        self.reads += 1
        if after == "":
            return [], self.entries[-1][0]
        at = 0 if after == "0" else int(after.split("-")[1]) + 1
        part: list[tuple[str, np.ndarray]] = []
        for entry in self.entries[at : at + self.per_read]:
            if part and sum(t.size for _, t in part) + entry[1].size > max_tokens:
                break
            part.append(entry)
        return part, part[-1][0] if part else after


def test_a_start_reads_the_whole_log_in_short_pages_and_keeps_its_newest_entries() -> None:
    log = Log([5] * 40, per_read=3)  # every page well short of what a read may hold
    entries, after = read_recent(log, 52, 10.0)
    assert after == "1-39" and [int(e[0]) for e in entries] == list(range(30, 40))
    assert log.reads == 15  # 14 pages, then one that comes back empty: the end
    assert read_recent(Log([5], per_read=3), 1, 10.0)[0] == []  # an entry larger than the memory: none kept


def test_following_reads_a_backlog_back_to_back_and_hands_it_over_in_budgets() -> None:
    # 20,000-token entries: three fill most of a read (the fourth would overflow it).
    log = Log([20_000] * 10, per_read=100)
    follower = LogFollower(log, OwnCommits(), after="0")
    reads = [follower.read_once() for _ in range(4)]
    assert reads == [True, True, True, False]  # read again at once while pages come back full
    assert follower.followed == 10 and log.reads == 4
    # At most 50,000 tokens a take (at least one entry): the backlog comes over in parts, oldest first.
    parts = [follower.take(50_000) for _ in range(6)]
    assert [len(p) for p in parts] == [2, 2, 2, 2, 2, 0]
    assert [int(e[0]) for p in parts for e in p] == list(range(10))
    # A trickle of small commits is read once a turn, not again at once.
    log.entries += [(f"1-{i}", np.full(30, i, dtype=np.int32)) for i in (10, 11)]
    assert follower.read_once() is False and [e.size for e in follower.take()] == [30, 30]
    log.entries.append(("1-12", np.full(90_000, 12, dtype=np.int32)))
    follower.read_once()
    assert [e.size for e in follower.take(50_000)] == [90_000]  # one entry over the budget still comes
