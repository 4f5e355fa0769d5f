"""Running the service: storage (given or embedded), schema check, restore, background jobs,
the gRPC server, and an orderly shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar

from apscheduler.schedulers.background import BackgroundScheduler

import migrations
from cache_service.config import EmbeddedRedisConfig, ServerConfig, ServiceConfig
from cache_service.domain.changes import Changes, Saved
from cache_service.domain.ports import StorageHealth
from cache_service.domain.service import DraftService
from cache_service.host import compile_ahead
from cache_service.host.compiles import CompileWatch
from cache_service.host.embedded_redis import EmbeddedRedis
from cache_service.host.journal import Journal, journal_path
from cache_service.host.malloc import release_free_memory
from cache_service.host.shared_indexes import SharedIndexes
from cache_service.metrics import Metrics
from cache_service.persistence import RedisPersistence, SessionsNotSaved
from cache_service.rpc import wire
from cache_service.rpc.server import check_files, create_server
from cache_service.storage import keys
from cache_service.storage.clients import StorageClient
from cache_service.storage.connect import Cutoff, connect, connect_for_calls, redact
from cache_service.storage.errors import MigrationInProgress, StorageError
from cache_service.storage.redis_store import RedisStore, StoreConfig
from cache_service.sync import StorageSync
from indexer import kernels

logger = logging.getLogger(__name__)

PRIOR_POLL_S = 2.0
DELTA_CHECK_S = 1.0  # how often a delta past its limit is looked for
TAKE_SLICE_S = 0.002  # longest the serving loop spends on one slice of a write-back round
EARLY_REBUILD_GAP_S = 1.0  # least time between early rebuilds of one namespace
# With shared indexes every generation is also written whole to the lifetime folder (8 bytes a
# token: 134 MB for a full buffer), so they come less often.
SHARED_EARLY_REBUILD_GAP_S = 5.0
# A stop after the drain (ServerConfig.grace_s): the background jobs under way get STOP_JOBS_S
# to end, then their storage calls are cut short; the sessions' last write-back and the replay
# of journaled commits get STOP_STORAGE_S, then theirs are. A hung Redis (a storage call waits
# 30 s on it, then once more) holds a stop no longer than that.
STOP_JOBS_S = 2.0
STOP_STORAGE_S = 3.0

T = TypeVar("T")


def stop_seconds(grace_s: float) -> float:
    """The longest :meth:`App.stop` waits, whatever storage does, before it stops the embedded
    Redis (:meth:`EmbeddedRedis.stop`, up to its ``timeout_s`` more): the drain, the jobs'
    end, the last writes. Work on the CPU comes on top: a lifetime index being rebuilt is
    finished (a second or a few).

    >>> stop_seconds(5.0)
    10.0
    """
    return grace_s + STOP_JOBS_S + STOP_STORAGE_S


@dataclass(frozen=True, kw_only=True)
class AppConfig:
    service: ServiceConfig = field(default_factory=ServiceConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    redis_url: str | None = None  # None: spawn the embedded server
    embedded: EmbeddedRedisConfig = field(default_factory=EmbeddedRedisConfig)
    metrics_port: int | None = None  # Prometheus /metrics on this port (0: any free one); None: off
    metrics_host: str = "0.0.0.0"
    prior_dir: Path | None = None  # priors saved and memory-mapped here (shared by processes)
    lifetime_dir: Path | None = None  # lifetime indexes built once and memory-mapped here (shared by processes)
    # The folder of the journals of commits storage could not take (None: beside the embedded
    # Redis's folder): this process's own, and any a stopped process left, which it takes over.
    journal_dir: Path | None = None
    worker: int | None = None  # this process's index among ``serve --processes`` workers
    # How long a call waits on storage (a commit's append, a stored session, a log or prior
    # page), one try: past it a commit is journaled and a read fails UNAVAILABLE. The background
    # jobs keep the long timeouts that large prior parts need.
    call_timeout_s: float = 2.0
    # Replicas of the Redis master that must have a commit before it is acknowledged (WAIT, for
    # at most half the call timeout; where fewer confirm, it is journaled too): 0, the master's
    # answer is enough, which a failover to a replica behind it can undo.
    commit_replicas: int = 0

    def __post_init__(self) -> None:
        if not 0.05 <= self.call_timeout_s <= 60:
            raise ValueError(f"call_timeout_s must be in [0.05, 60], got {self.call_timeout_s}")
        if not 0 <= self.commit_replicas <= 16:
            raise ValueError(f"commit_replicas must be in [0, 16], got {self.commit_replicas}")

    @property
    def journal_root(self) -> Path:
        return self.journal_dir or self.embedded.data_dir.parent / "journal"

    @property
    def journal_path(self) -> Path:
        return journal_path(self.journal_root, self.worker)

    @property
    def ports(self) -> frozenset[int]:
        """The fixed ports this process serves on (gRPC, its own port, metrics).

        >>> sorted(AppConfig(server=ServerConfig(port=7000, own_port=7001), metrics_port=9100).ports)
        [7000, 7001, 9100]
        >>> AppConfig(server=ServerConfig(port=0)).ports
        frozenset()
        """
        return frozenset(p for p in (self.server.port, self.server.own_port, self.metrics_port) if p)


def prepare_schema(client: StorageClient, *, wait_s: float = 60.0) -> int:
    """Initialise an empty Redis; refuse an older (not migrated) or unknown newer schema.

    Replicas starting together on a fresh Redis race to initialise it: the ones that find
    another holding the migration lock wait for it (up to ``wait_s``) and check its result.
    """
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if migrations.stored_version(client) == 0:
                migrations.apply(client)
            elif client.exists(keys.MIGRATION_LOCK):  # someone is migrating: wait for the result
                raise MigrationInProgress("a migration is running")
            return migrations.check(client)
        except MigrationInProgress:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


class App:
    """Everything ``serve`` runs, started by :meth:`start` and stopped by :meth:`stop`."""

    def __init__(self, config: AppConfig) -> None:
        self.config = config
        self.embedded: EmbeddedRedis | None = None
        self.scheduler = BackgroundScheduler(job_defaults={"coalesce": True, "max_instances": 1})
        self.metrics = Metrics()
        self.compiles = CompileWatch(self.metrics.observe_compile)  # from serving on
        self.sessions_saved = time.monotonic()  # when storage last held every session change
        self._last_rebuild: dict[str, float] = {}  # per namespace, when its last rebuild ended
        self.url = config.redis_url or ""
        # Ends the background client's calls (the jobs', the start's, the last writes'): a stop
        # never waits out a hung Redis.
        self.cutoff = Cutoff()
        self._steps: list[threading.Thread] = []  # the start's long steps, on threads of their own

    async def start(self) -> int:
        """Start serving; returns the bound port. A start that fails, or is cancelled (a stop
        asked meanwhile), stops what it started; a compilation or restore under way is left to
        its thread (see :meth:`left_running`)."""
        try:
            return await self._start()
        except BaseException:
            await self._abandon()
            raise

    def left_running(self) -> bool:
        """Whether a step of an abandoned start still runs (a compilation cannot be interrupted):
        the process must then end without waiting for it."""
        return any(t.is_alive() for t in self._steps)

    async def _abandon(self) -> None:
        """Stop what a failed or cancelled start had started: the storage calls under way (a
        schema check, a restore), the server, the journal, the embedded Redis (else left running
        with nobody to stop it)."""
        self.cutoff.cut()
        server = getattr(self, "server", None)
        if server is not None:
            await server.stop(0)
        if self.scheduler.running:
            self.scheduler.shutdown(wait=False)
        persistence = getattr(self, "persistence", None)
        if persistence is not None:
            await asyncio.to_thread(_close_journal, persistence)
        if self.embedded is not None:
            await asyncio.to_thread(self.embedded.stop)

    def _step(self, fn: Callable[..., T], *args: object) -> asyncio.Future[T]:
        """``fn(*args)`` on a daemon thread of its own, as a future: a start cancelled meanwhile
        leaves it, and the process can end without it (a compilation, which nothing interrupts,
        takes a minute or two on a fresh machine; ``asyncio.to_thread``'s threads are waited
        for at exit)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def settle(value: object, failed: bool) -> None:
            if future.done():  # cancelled
                return
            if failed:
                future.set_exception(value)  # type: ignore[arg-type]
            else:
                future.set_result(value)  # type: ignore[arg-type]

        def run() -> None:
            value: object
            try:
                value, failed = fn(*args), False
            except BaseException as exc:  # handed to the awaiting start
                value, failed = exc, True
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                loop.call_soon_threadsafe(settle, value, failed)

        thread = threading.Thread(target=run, name=f"start-{getattr(fn, '__name__', 'step')}", daemon=True)
        self._steps.append(thread)
        thread.start()
        return future

    async def _start(self) -> int:
        self._loop = asyncio.get_running_loop()
        check_files(self.config.server)  # before anything is started
        if not self.url:
            self.embedded = EmbeddedRedis(self.config.embedded, avoid=self.config.ports)
            # Waited for even by a start cancelled meanwhile: stopped then, never left behind.
            await _to_the_end(asyncio.to_thread(self.embedded.start))
            self.url = self.embedded.url
            (self.config.embedded.data_dir / "url").write_text(self.url)
        client = connect(self.url, cutoff=self.cutoff)
        logger.info("storage schema v%d at %s", await asyncio.to_thread(prepare_schema, client), redact(self.url))
        store = RedisStore(client, self.config.store)
        quick = await asyncio.to_thread(connect_for_calls, self.url, self.config.call_timeout_s)
        calls = RedisStore(quick, store.config)
        lifetime_dir = self.config.lifetime_dir
        lifetime = self.config.service.drafter.lifetime
        cfg = self.config
        journal = Journal(cfg.journal_path, cfg.service.journal_capacity_bytes, root=cfg.journal_root)
        self.persistence = RedisPersistence(
            store,
            max_pending=cfg.service.max_pending_writes,
            prior_dir=cfg.prior_dir,
            journal=journal,
            calls=calls,
            replicas=cfg.commit_replicas,
            wait_ms=max(1, int(cfg.call_timeout_s * 500)),
        )
        await asyncio.to_thread(self.persistence.commits.recover)  # replayed by the restore's flush
        if self.embedded is not None:
            self.embedded.supervise(on_exit=self._storage_died, on_restart=self.metrics.observe_embedded_restart)
        self.shared = None if lifetime_dir is None else SharedIndexes(store, lifetime_dir, lifetime)
        self.service = DraftService(self.config.service, self.persistence, shared_lifetime=lifetime_dir is not None)
        self.sync = StorageSync(self.service, self.persistence, self.shared)
        self.service.refresh = self._refresh
        # The compiled loops are built (or loaded from numba's cache) here, off the event loop and
        # before serving: on a fresh machine that takes minutes, which the first
        # CreateNamespace would otherwise spend on the loop with every other call waiting.
        threads = self.config.service.drafter.threads
        # Workers of `serve --processes` each compile for themselves, side by side already.
        await self._step(functools.partial(warm_up, threads, ahead=self.config.worker is None))
        if self.shared is not None:
            await self._step(self.shared.warm, threads)
        await self._step(self.sync.restore)
        release_free_memory()  # the log read back and the builds done to restore it
        self._schedule()
        self.server = await create_server(
            self.config.server, self.service, self.metrics.observe_rpc, storage_health=self.storage_health
        )
        self.metrics.served_by(self.service.namespace_names)  # rebuild series go with their namespace
        if self.config.metrics_port is not None:
            self.metrics.watch(
                self.service, self.persistence, session_saves=lambda: self.sessions_saved, storage=self.storage_health
            )
            port = self.metrics.serve(self.config.metrics_port, self.config.metrics_host)
            logger.info("metrics on http://%s:%d/metrics", self.config.metrics_host, port)
        await self.server.set_serving(True)  # indexes are loaded: ready
        self.compiles.start()
        return self.server.port

    def storage_health(self) -> StorageHealth:
        """Where storage stands: the commit path's view, and the embedded server's restarts."""
        health = self.persistence.commits.health()
        return replace(health, embedded_restarts=0 if self.embedded is None else self.embedded.restarts)

    def _storage_died(self, why: str, disk_full: bool) -> None:
        self.persistence.commits.status.failed(f"embedded Redis died: {why}", disk_full=disk_full)

    def _schedule(self) -> None:
        cfg = self.config.service
        self.scheduler.add_job(self.sync.sync, "interval", seconds=cfg.follow_interval_s)
        self.scheduler.add_job(self._save_sessions, "interval", seconds=cfg.flush_interval_s)
        self.scheduler.add_job(self._rebuild, "interval", seconds=cfg.rebuild_interval_s)
        self.scheduler.add_job(self._rebuild_large_deltas, "interval", seconds=DELTA_CHECK_S)
        self.scheduler.add_job(self.sync.reload_priors, "interval", seconds=PRIOR_POLL_S)
        self.scheduler.start()

    def _save_sessions(self) -> None:
        """Take changed sessions on the serving loop, write them from this job's thread."""
        future = asyncio.run_coroutine_threadsafe(self._take_changes(), self._loop)
        changed, closed = future.result(timeout=30)
        if not changed and not closed:
            self.sessions_saved = time.monotonic()  # nothing waits: storage is up to date
        else:
            try:
                saved = self.persistence.save_sessions(changed, closed, self.config.service.session_ttl_s)
                self.sessions_saved = time.monotonic()
            except StorageError as exc:
                logger.warning("session write-back deferred: %s", exc)
                missed = [sid for sid, _ in changed]
                asyncio.run_coroutine_threadsafe(self._requeue(missed, closed), self._loop).result(timeout=30)
            else:
                if saved.missed or saved.written or saved.refused:
                    asyncio.run_coroutine_threadsafe(self._saved(saved), self._loop).result(timeout=30)

    async def _requeue(self, sids: list[str], closed: list[str]) -> None:
        self.service.requeue(sids, closed)

    async def _saved(self, saved: Saved) -> None:
        self.service.saved(saved)

    async def _take_changes(self) -> Changes:
        """One round of changes, taken a slice at a time with the loop serving calls in between
        (the whole round at once held every call up 7 ms at the median and 75 ms at worst,
        every write-back period, under 8 x 32 decoders: rejected tables are slow to copy)."""
        changed, closed = self.service.take_changes(budget_s=TAKE_SLICE_S)
        while self.service.taking:
            await asyncio.sleep(0)  # what waits on the loop goes first
            more, gone = self.service.take_changes(budget_s=TAKE_SLICE_S)
            changed.extend(more)
            closed.extend(gone)
        return changed, closed

    def _rebuild(self) -> None:
        """Rebuild the namespaces that have new requests since their last index."""
        for name in self.service.namespace_names():
            memory = self.service.namespace(name).memory
            if memory.delta_tokens() > 0 or self.shared is not None:  # shared: new in the log?
                self._rebuild_one(name, "")

    def _rebuild_large_deltas(self) -> None:
        """Rebuild early a namespace whose delta outgrew its limit (a burst of requests), but
        leave at least twice the last build's time (and a second) between builds: under
        sustained heavy traffic rebuilds take at most a third of a core. A rebuild extends the
        last generation, at a cost that follows the delta, not the buffer, so under steady
        traffic they come about once a second and keep the delta (searched by every draft)
        near its limit; shared generations, written whole to disk, at most every few seconds.
        With shared indexes, also serve any generation another process published."""
        self.sync.adopt_published()
        now = time.monotonic()
        shared = self.shared is not None
        served = self.service.namespace_names()
        for gone in set(self._last_rebuild) - set(served):  # names come and go for weeks
            self._last_rebuild.pop(gone, None)
        for name in served:
            memory = self.service.namespace(name).memory
            built = memory.indexes
            gap = early_rebuild_gap(None if built is None else built.build_seconds, shared=shared)
            if memory.needs_rebuild() and now - self._last_rebuild.get(name, 0.0) >= gap:
                self._rebuild_one(name, " early")

    def _rebuild_one(self, name: str, why: str) -> None:
        try:
            self._rebuild_measured(name, why)
        except StorageError as exc:  # shared indexes are built from the log in storage
            logger.warning("rebuild of %s deferred: %s", name, exc)
        except Exception:  # a full disk, say: the other namespaces are rebuilt all the same
            logger.exception("rebuild of %s failed (tried again on the next run)", name)

    def _refresh(self, names: list[str]) -> None:
        """The admin rebuild: published priors reloaded and the named namespaces rebuilt now
        (after a build under way in another process), measured as the scheduler's builds are;
        a failure goes to the caller."""
        self.sync.reload_priors()
        for name in names:
            self._rebuild_measured(name, " on request", wait=True)

    def _rebuild_measured(self, name: str, why: str, *, wait: bool = False) -> None:
        """Rebuild ``name`` (:meth:`~.sync.StorageSync.rebuild`), then measure and log the build
        if this process made it (not one it found already built: shared, another may have; or
        none was due)."""
        try:
            had = self.service.namespace(name).memory.indexes
            built = self.sync.rebuild(name, wait=wait)
        finally:
            self._last_rebuild[name] = time.monotonic()
            release_free_memory()  # what the build allocated and freed
        if built is not None and built is not had:
            self.metrics.observe_rebuild(name, built)
            how = "extended" if built.extended else "sorted afresh"
            table = "new table" if built.table_version is None else "table carried over"
            logger.info(
                "rebuilt %s%s: %d tokens in %.2f s (%s, %s)",
                name,
                why,
                built.suffix.size,
                built.build_seconds,
                how,
                table,
            )

    async def stop(self) -> None:
        """NOT_SERVING, drain in-flight calls (``grace_s``), stop the jobs, write back the
        sessions and replay journaled commits, stop Redis: within :func:`stop_seconds` whatever
        storage does. The jobs under way get :data:`STOP_JOBS_S` to end, then their storage
        calls are cut short; the last writes get :data:`STOP_STORAGE_S`, then theirs are. What
        storage has not taken by then: commits stay in the journal (fsynced; replayed at the
        next start), and the sessions' last changes are given up, with a warning counting them
        (those sessions continue from their last stored copy, if any)."""
        await self.server.stop(self.config.server.grace_s)
        self.compiles.stop()
        # Jobs go first: removing them waits out a scheduling pass that may be handing one to
        # the executor, which shutdown would otherwise close under it. Off the loop: a running
        # write-back job waits on the loop for its changes.
        self.scheduler.remove_all_jobs()
        jobs = asyncio.ensure_future(asyncio.to_thread(self.scheduler.shutdown, wait=True))
        ended, _ = await asyncio.wait({jobs}, timeout=STOP_JOBS_S)
        if not ended:
            logger.warning("background jobs still running %.0f s into the stop: storage calls cut short", STOP_JOBS_S)
            self.cutoff.cut()
            await jobs
        self.cutoff.restore()
        self.cutoff.cut_at(time.monotonic() + STOP_STORAGE_S)
        try:
            await self._final_save()
            await asyncio.to_thread(self.sync.sync)  # journaled commits into the log, if it takes them
        finally:
            self.cutoff.cut()
        if self.persistence.pending:
            left, path = self.persistence.pending, self.config.journal_path
            logger.warning("%d commits stay in the journal %s for the next start", left, path)
        self.persistence.commits.close()
        if self.embedded is not None:
            await asyncio.to_thread(self.embedded.stop)

    async def _final_save(self) -> None:
        """The sessions' last write-back; what storage does not take is given up, and counted."""
        ttl = self.config.service.session_ttl_s
        changed, closed = self.service.take_changes(final=True)
        try:
            saved = await asyncio.to_thread(self.persistence.save_sessions, changed, closed, ttl)
            self.service.saved(saved)
            if saved.missed:  # appends storage could not take: once more, whole
                changed, _ = self.service.take_changes(final=True)
                await asyncio.to_thread(self.persistence.save_sessions, changed, [], ttl)
        except SessionsNotSaved as exc:
            logger.warning(
                "session write-back at shutdown cut short (%s): the last changes of %d sessions are lost "
                "(they continue from their last stored copy), %d closed sessions not deleted (they expire)",
                exc, len(exc.unsaved), exc.undeleted,
            )  # fmt: skip
        except StorageError as exc:
            logger.warning("session state of %d sessions not written back at shutdown: %s", len(changed), exc)


def early_rebuild_gap(last_build_seconds: float | None, *, shared: bool) -> float:
    """Least seconds from a namespace's last rebuild to an early one: twice the last build's
    time (rebuilds then take at most a third of a core), and at least a second, or
    :data:`SHARED_EARLY_REBUILD_GAP_S` when every generation is written to disk; none before
    the first build.

    >>> early_rebuild_gap(0.2, shared=False), early_rebuild_gap(3.0, shared=False), early_rebuild_gap(0.2, shared=True)
    (1.0, 6.0, 5.0)
    """
    if last_build_seconds is None:
        return 0.0
    return max(SHARED_EARLY_REBUILD_GAP_S if shared else EARLY_REBUILD_GAP_S, 2 * last_build_seconds)


def _warm_up_beside_draft_step() -> None:
    """What a first start compiles beside the draft step: the kernels it does not call and the
    reply encoder."""
    kernels.warm_up_beside_draft_step()
    wire.warm_up()


def warm_up(threads: int = 1, *, ahead: bool = False, report_every_s: float = 15.0) -> None:
    """Compile (or load) every compiled loop the service runs: drafting (on ``threads`` worker
    threads too, when more than one) and the reply encoder. Loading from numba's cache takes a
    few seconds; compiling, on a machine's first start, two to four minutes: the log says which
    it is and how long it has taken, so a first start is not mistaken for a hang. With
    ``ahead``, a first start shares the compilation among processes
    (:mod:`cache_service.host.compile_ahead`)."""
    steps: list[tuple[str, Callable[[], object]]] = [
        ("drafting kernels", kernels.warm_up),
        ("reply encoder", wire.warm_up),
    ]
    if threads > 1:
        steps.insert(1, ("threaded draft step", kernels.warm_up_threads))
    start = time.monotonic()
    done = threading.Event()

    def heartbeat() -> None:
        while not done.wait(report_every_s):
            logger.info(
                "still compiling (%.0f s so far; the compiled code is cached for later starts)",
                time.monotonic() - start,
            )

    threading.Thread(target=heartbeat, name="compile-progress", daemon=True).start()
    try:
        if ahead and compile_ahead.needed():
            logger.info("first start here: compiling the draft step and the other kernels in two processes")
            shares = (kernels.warm_up_draft_step, _warm_up_beside_draft_step)
            logger.info("shared compilation done in %.1f s", compile_ahead.compile_ahead(shares))
        for i, (what, step) in enumerate(steps, 1):
            logger.info("compiling or loading %s (%d of %d)", what, i, len(steps))
            step()
    finally:
        done.set()
    logger.info("compiled loops ready in %.1f s", time.monotonic() - start)


async def _to_the_end(awaitable: Awaitable[T]) -> T:
    """``await awaitable``, which a cancellation does not cut short: it is raised once the
    awaitable is done (what it starts is then known, and stopped)."""
    future = asyncio.ensure_future(awaitable)
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        while not future.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({future})
        raise


def _close_journal(persistence: RedisPersistence) -> None:
    """Close the journal once a replay under way (an abandoned restore's, its storage calls cut)
    has let go of it."""
    if persistence.commits.writing.acquire(timeout=STOP_STORAGE_S):
        persistence.commits.writing.release()
    persistence.commits.close()


async def serve(config: AppConfig, serving: Callable[[], Coroutine[None, None, None]] | None = None) -> None:
    """Run until SIGINT or SIGTERM; ``serving`` runs on the loop from the start of serving
    until the loop ends (a worker's heartbeat: it beats through the drain too).

    The signals are taken from the first moment: one during the start (a compilation, a
    restore: tens of seconds) ends the start early and stops what it started (the embedded Redis
    among it), and the process ends normally; where a compilation was left under way (nothing
    interrupts it) it ends with ``os._exit(0)``, which does not wait for it."""
    kernels.prefer_passive_workers()
    sys.setswitchinterval(config.server.switch_interval_s)
    asked = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, asked.set)
    app = App(config)
    starting = asyncio.ensure_future(app.start())
    stop_asked = asyncio.ensure_future(asked.wait())
    await asyncio.wait({starting, stop_asked}, return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        logger.info("stop asked while starting: the start is abandoned")
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await starting  # it stops what it started
        logger.info("stopped before serving")
        if app.left_running():
            logging.shutdown()  # the log written out first
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        return
    try:
        port = starting.result()  # a failed start raises here
    except BaseException:
        stop_asked.cancel()
        raise
    print(f"draftcache serving on {config.server.host}:{port} (storage {redact(app.url)})", flush=True)
    beside = None if serving is None else asyncio.create_task(serving())  # held: tasks are weakly kept
    await stop_asked
    logger.info("shutting down")
    await app.stop()
    if beside is not None:  # it beat through the drain; the loop ends now
        beside.cancel()
