"""Commits through the journal, on a real Redis: journaled while storage is down, replayed
once when it returns, again once after a crash that replays the same journal twice, and
refused (never dropped) when the journal cannot take them."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from cache_service.commits import CommitWriter
from cache_service.config import EmbeddedRedisConfig
from cache_service.domain.errors import Unavailable
from cache_service.host.embedded_redis import EmbeddedRedis, find_server_binary, free_port
from cache_service.host.journal import Journal, encode
from cache_service.persistence import RedisPersistence
from cache_service.storage.connect import connect
from cache_service.storage.errors import StorageError
from cache_service.storage.redis_store import RedisStore
from tests.faults import can_mount_tmpfs, fill_disk, small_disk
from tests.service.conftest import eventually


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedRedis]:
    redis = EmbeddedRedis(EmbeddedRedisConfig(data_dir=tmp_path / "redis", appendonly=True)).start()
    yield redis
    redis.stop()


def _req(i: int) -> np.ndarray:
    return np.array([i, i + 1, i + 2], dtype=np.int32)


def _registered(store: RedisStore) -> RedisStore:
    """A store whose namespace ``ns`` is registered, as the service's always is before it commits."""
    store.register_namespace("ns", 1000)
    return store


def _log(store: RedisStore) -> list[list[int]]:
    return [e.tokens.tolist() for e in store.read_log("ns", count=10_000)]


def _restart(server: EmbeddedRedis) -> EmbeddedRedis:
    config = EmbeddedRedisConfig(data_dir=server.config.data_dir, appendonly=True, port=server.port)
    return EmbeddedRedis(config).start()


def test_journaled_commits_reach_the_log_once_across_crashes(server: EmbeddedRedis, tmp_path: Path) -> None:
    store = _registered(RedisStore(connect(server.url)))
    path = tmp_path / "journal" / "commits.journal"
    writer = CommitWriter(store, max_pending=100, journal=Journal(path, 1 << 20))
    assert writer.recover() == 0
    writer.commit("ns", [_req(0)])  # storage up: written at once, nothing journaled
    assert path.stat().st_size == 0
    server.stop()
    writer.commit("ns", [_req(1), _req(2)])
    writer.commit("ns", [_req(3)])
    health = writer.health()
    assert not health.available and health.journaled_commits == 3 and health.journal_bytes == path.stat().st_size
    journal_then = path.read_bytes()
    writer.close()  # the process dies here; its journal stays
    server = _restart(server)
    try:
        # The next process replays the journal; it follows those commits from the log like
        # another process's (they are not in its memory).
        second = RedisPersistence(store, max_pending=100, journal=Journal(path, 1 << 20))
        second.read_log("ns")
        assert second.commits.recover() == 3
        assert second.flush() == [("ns", [], [])]
        assert path.stat().st_size == 0 and second.pending == 0 and second.commits.health().available
        assert [t.tolist() for t in second.follow("ns")[0]] == [_req(i).tolist() for i in (1, 2, 3)]
        second.commits.close()
        # ...and a crash before it emptied the journal replays it again: skipped, not doubled.
        path.write_bytes(journal_then)
        third = CommitWriter(store, max_pending=100, journal=Journal(path, 1 << 20))
        assert third.recover() == 3
        assert third.flush() == [("ns", [], [])]
        assert _log(store) == [_req(i).tolist() for i in range(4)]
        third.close()
    finally:
        server.stop()


def test_a_failed_write_queues_in_commit_order(server: EmbeddedRedis, tmp_path: Path) -> None:
    """A commit whose write failed goes before later ones already journaled: a writer's commits
    reach the log in order, which the append-once check relies on."""
    store = _registered(RedisStore(connect(server.url)))
    writer = CommitWriter(store, max_pending=100, journal=Journal(tmp_path / "j", 1 << 20))
    writer.recover()
    failing = writer._records("ns", [_req(9)], writer._log("ns"))  # numbered first, its write under way (say, hung)...
    with writer.writing:  # ...others journal rather than wait
        writer.commit("ns", [_req(10)])
        writer.commit("ns", [_req(11)])
    assert writer.pending == 2
    with writer._lock:  # the write under way failed: journaled now
        writer._journal(failing)
    [(_, written, _)] = writer.flush()
    assert [t.tolist() for t in written] == [_req(9).tolist(), _req(10).tolist(), _req(11).tolist()]
    writer.close()


def test_commits_redis_refuses_are_journaled(server: EmbeddedRedis, tmp_path: Path) -> None:
    """Redis up but refusing writes (out of memory here; MISCONF alike): journaled, then replayed."""
    store = _registered(RedisStore(connect(server.url)))
    writer = CommitWriter(store, max_pending=100, journal=Journal(tmp_path / "j", 1 << 20))
    writer.recover()
    store.client.config_set("maxmemory-policy", "noeviction")
    store.client.config_set("maxmemory", 1)
    try:
        writer.commit("ns", [_req(0), _req(1)])
        health = writer.health()
        assert writer.pending == 2 and not health.available and "refuses writes" in health.last_error
    finally:
        store.client.config_set("maxmemory", 0)
    writer.flush()
    assert _log(store) == [_req(0).tolist(), _req(1).tolist()] and writer.health().available
    # Storage said down by another (the embedded Redis's supervisor), nothing to replay: the
    # next flush finds it back all the same.
    writer.status.failed("embedded Redis died")
    assert not writer.health().available
    assert writer.flush() == [] and writer.health().available
    writer.close()


def test_a_full_journal_refuses_the_commit(server: EmbeddedRedis, tmp_path: Path) -> None:
    store = _registered(RedisStore(connect(server.url)))
    one = len(encode(CommitWriter(store, max_pending=1)._records("ns", [_req(0)])[0]))
    writer = CommitWriter(store, max_pending=100, journal=Journal(tmp_path / "j", 2 * one))
    writer.recover()
    server.stop()
    writer.commit("ns", [_req(0)])
    writer.commit("ns", [_req(1)])
    with pytest.raises(Unavailable, match="journal full"):
        writer.commit("ns", [_req(2)])
    assert writer.pending == 2 and not writer.health().disk_full
    server = _restart(server)
    try:
        writer.flush()
        assert _log(store) == [_req(0).tolist(), _req(1).tolist()]
    finally:
        server.stop()
        writer.close()


@pytest.mark.skipif(not can_mount_tmpfs(), reason="needs to mount a tmpfs (root)")
def test_a_full_disk_refuses_the_commit_and_says_so(server: EmbeddedRedis, tmp_path: Path) -> None:
    store = _registered(RedisStore(connect(server.url)))
    with small_disk(tmp_path / "disk", "1m") as disk:
        writer = CommitWriter(store, max_pending=10_000, journal=Journal(disk / "j", 1 << 30))
        writer.recover()
        server.stop()
        filler = fill_disk(disk)
        with pytest.raises(Unavailable, match="No space left"):
            writer.commit("ns", [_req(0)] * 2000)
        health = writer.health()
        assert health.disk_full and not health.available and writer.pending == 0
        assert "No space left" in health.last_error
        filler.unlink()
        writer.commit("ns", [_req(1)])  # room again: journaled
        assert writer.pending == 1
        writer.close()


def test_journaled_commits_of_a_deleted_namespace_do_not_recreate_it(server: EmbeddedRedis, tmp_path: Path) -> None:
    store = _registered(RedisStore(connect(server.url)))
    store.register_namespace("ns", 1000)
    store.register_namespace("kept", 1000)
    writer = CommitWriter(store, max_pending=100, journal=Journal(tmp_path / "commits.journal", 1 << 20))
    assert writer.recover() == 0
    server.stop()
    writer.commit("ns", [_req(1)])  # journaled: storage is down
    writer.commit("kept", [_req(2)])
    server = _restart(server)
    try:
        store.delete_namespace("ns")  # an admin deletes it before the journal drains
        writer.flush()
        # Nothing of the deleted namespace came back; the other namespace's commit is in.
        assert not list(store.client.scan_iter(match="*{ns}*"))
        assert [e.tokens.tolist() for e in store.read_log("kept")] == [_req(2).tolist()]
        assert writer.pending == 0
    finally:
        writer.close()
        server.stop()


def _server(folder: Path, port: int, *args: str) -> subprocess.Popen[bytes]:
    """A redis-server on ``port`` with its AOF (fsync always) in ``folder``, ready."""
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [str(find_server_binary()), "--bind", "127.0.0.1", "--port", str(port), "--dir", str(folder)]
    cmd += ["--appendonly", "yes", "--appendfsync", "always", "--save", "", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    eventually(lambda: _answers(port), timeout_s=10)
    return proc


def _answers(port: int) -> bool:
    try:
        return bool(connect(f"redis://127.0.0.1:{port}/0").ping())
    except (StorageError, OSError, redis.RedisError):
        return False


def test_a_commit_fewer_replicas_confirmed_is_journaled_and_survives_a_failover(
    server: EmbeddedRedis, tmp_path: Path
) -> None:
    """With ``replicas``, a commit the replica confirmed is acknowledged at once; one it could
    not confirm (the replica down) is journaled as well. When the master then dies and the
    replica, behind it, takes over, the journal's replay gives the new master every
    acknowledged commit, once."""
    store = _registered(RedisStore(connect(server.url)))
    port = free_port()
    replica = _server(tmp_path / "replica", port, "--replicaof", "127.0.0.1", str(server.port))
    try:
        eventually(lambda: store.client.wait(1, 100) == 1, timeout_s=10)  # in sync
        writer = CommitWriter(store, max_pending=100, journal=Journal(tmp_path / "j", 1 << 20), replicas=1, wait_ms=300)
        writer.recover()
        assert writer.commit("ns", [_req(1)]).logged and writer.pending == 0  # the replica has it
        replica.kill()
        replica.wait()
        logged = writer.commit("ns", [_req(2)]).logged  # in the master's log, unconfirmed
        assert [t.tolist() for t in logged[0][1]] == [_req(2).tolist()]
        assert writer.pending == 1 and _log(store) == [_req(1).tolist(), _req(2).tolist()]
        assert not writer.health().available and "replicas" in writer.health().last_error
        writer.close()
        server.stop()  # the master is gone; the replica comes back as the master
        replica = _server(tmp_path / "replica", port)
        promoted = RedisStore(connect(f"redis://127.0.0.1:{port}/0"))
        assert _log(promoted) == [_req(1).tolist()]  # what a failover alone would have kept
        after = CommitWriter(promoted, max_pending=100, journal=Journal(tmp_path / "j", 1 << 20))
        assert after.recover() == 1
        after.flush()
        assert _log(promoted) == [_req(1).tolist(), _req(2).tolist()] and after.pending == 0
        after.close()
    finally:
        replica.kill()
        replica.wait()


def test_a_keyed_commit_journaled_and_sent_again_reaches_the_log_once(server: EmbeddedRedis, tmp_path: Path) -> None:
    """A close whose answer was lost while storage was down is sent again by its client, under
    the key it named the first with: the journal holds both, across a restart of the service
    too, and its replay appends the first and skips the second. Sent once more with storage
    back, the log says it holds it."""
    store = _registered(RedisStore(connect(server.url)))
    path = tmp_path / "commits.journal"
    writer = CommitWriter(store, max_pending=100, journal=Journal(path, 1 << 20))
    writer.recover()
    key = "9f86d081884c7d659a2feaa0c55ad015"
    server.stop()
    assert writer.commit("ns", [_req(1)], [key]).repeated == [False]  # journaled: not known
    writer.commit("ns", [_req(1), _req(2)], [key, ""])  # the retry, and another request
    writer.close()  # the service stops before storage returns
    server = _restart(server)
    try:
        later = CommitWriter(store, max_pending=100, journal=Journal(path, 1 << 20))
        assert later.recover() == 3
        later.flush()
        assert _log(store) == [_req(1).tolist(), _req(2).tolist()] and later.health().repeated_commits == 1
        assert later.commit("ns", [_req(1), _req(3)], [key, ""]).repeated == [True, False]
        assert _log(store) == [_req(1).tolist(), _req(2).tolist(), _req(3).tolist()]
        later.close()
    finally:
        server.stop()


@pytest.mark.parametrize("replayed_first", [False, True], ids=["followed-first", "replayed-first"])
def test_a_journaled_commit_sent_again_to_another_replica_enters_this_memory_once(
    server: EmbeddedRedis, tmp_path: Path, replayed_first: bool
) -> None:
    """Replica A journals a close while storage is down (the request is in A's memory); its
    client, the answer lost, sends it again under the same key to replica B once storage is
    back, and B appends it. A's replay then finds it logged and appends nothing, and A, following
    the log, skips B's entry of it (its key is one A journaled), whichever comes first, while
    taking B's other requests. Before entries held their keys, A took its own request again."""
    key = "c0ffee00c0ffee00c0ffee00c0ffee00"
    a = RedisPersistence(_registered(RedisStore(connect(server.url))), max_pending=100,
                         journal=Journal(tmp_path / "a.journal", 1 << 20))  # fmt: skip
    a.commits.recover()  # its journal opened (empty)
    a.read_log("ns")  # following from the log's start
    server.stop()
    assert a.requests_committed("ns", [_req(1)], [key]).repeated == [False]  # journaled
    assert a.commits.health().journaled_commits == 1
    server = _restart(server)
    try:
        b = RedisPersistence(RedisStore(connect(server.url)), max_pending=100)
        assert b.requests_committed("ns", [_req(1), _req(7)], [key, ""]).repeated == [False, False]
        if replayed_first:
            a.flush()
        followed = a.follow("ns").tokens
        a.flush()
        assert [t.tolist() for t in followed] == [_req(7).tolist()]
        assert a.commits.health().journaled_commits == 0 and a.commits.health().repeated_commits == 1
        assert _log(RedisStore(connect(server.url))) == [_req(1).tolist(), _req(7).tolist()]
        assert a.follow("ns").tokens == []  # nothing else new
        assert not a._held.get("ns")  # the key went when its entry passed
    finally:
        server.stop()
