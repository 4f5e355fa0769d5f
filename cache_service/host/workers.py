"""Several server processes on one port, one per core: ``draftcache serve --processes N``.

Python serves one core per process, so a host runs several. They share the port (the kernel
spreads connections over them, ``SO_REUSEPORT``: by a hash of each connection's addresses, so a
few long-lived connections can pile onto one worker) and one Redis. With ``--worker-ports BASE``
worker ``i`` also serves ``BASE + i`` alone, for clients that place themselves (one decoder per
worker, say). Each worker follows the same lifetime log, and a session opened in one continues
in another from its stored copy. The supervisor starts the embedded Redis when no URL is given,
restarts a worker that dies or hangs, and on SIGTERM or SIGINT stops them all gracefully. A
worker's serving loop beats once a second; one silent for :data:`HANG_S` (stopped, deadlocked)
is killed and replaced: the kernel goes on handing it its share of new connections, which would
wait on it for as long as it hangs (a worker stopped with SIGSTOP took half the connections of
``--processes 2`` with it, until it was continued). Static priors
and lifetime indexes, the largest things a process holds, are written once into shared folders
and memory-mapped by every worker (one worker at a time builds the lifetime indexes:
:mod:`cache_service.host.shared_indexes`).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import threading
import time
from dataclasses import dataclass, replace
from multiprocessing.process import BaseProcess
from multiprocessing.sharedctypes import Synchronized

from cache_service import logs
from cache_service.app import AppConfig, stop_seconds
from cache_service.host.embedded_redis import EmbeddedRedis
from cache_service.rpc.server import check_files

logger = logging.getLogger(__name__)

RESTART_PAUSE_S = 1.0  # between a worker's death and its replacement
BEAT_S = 1.0  # between a serving worker's heartbeats
# A serving worker whose loop has not beaten for this long is killed and replaced. Longer than
# the loop is ever held while it works: a compilation while serving holds it seconds (tens on
# a fresh machine, once); a start's compilations come before the first beat.
HANG_S = 60.0
# What a worker's stop may take past :func:`~cache_service.app.stop_seconds` (a rebuild being
# finished, its log written) before it is killed: its journal keeps what it acknowledged.
STOP_SLACK_S = 10.0


def worker_config(config: AppConfig, index: int, redis_url: str, worker_ports: int | None = None) -> AppConfig:
    """Worker ``index``'s configuration: the shared Redis, its own metrics port if any, its own
    serving port ``worker_ports + index`` if asked, and one folder each of memory-mapped priors
    and lifetime indexes for all, and a commit journal of its own in the common journal folder."""
    metrics = None if config.metrics_port is None else config.metrics_port + index
    prior_dir = config.prior_dir or config.embedded.data_dir.parent / "priors"
    lifetime_dir = config.lifetime_dir or config.embedded.data_dir.parent / "lifetime"
    own_port = config.server.own_port if worker_ports is None else worker_ports + index
    server = replace(config.server, own_port=own_port, shared_port=True)
    return replace(
        config,
        server=server,
        redis_url=redis_url,
        metrics_port=metrics,
        prior_dir=prior_dir,
        lifetime_dir=lifetime_dir,
        journal_dir=config.journal_root,
        worker=index,
    )


def check_ports(config: AppConfig, processes: int, worker_ports: int | None) -> frozenset[int]:
    """Refuse port ranges that overlap: the shared port, the workers' own ports and their
    metrics ports. Returns the fixed ports among them (0, any free port, is none)."""
    taken: dict[int, str] = {config.server.port: "the serving port"}
    ranges = [("worker ports", worker_ports), ("metrics ports", config.metrics_port)]
    for name, base in ranges:
        if base is None:
            continue
        if base + processes - 1 > 65535:
            raise ValueError(f"{name} {base}..{base + processes - 1} run past 65535")
        for port in range(base, base + processes):
            if port in taken:
                raise ValueError(f"{name} {base}..{base + processes - 1} overlap {taken[port]} ({port})")
            taken[port] = name
    return frozenset(p for p in taken if p)


def _run(config: AppConfig, log_format: str, verbose: bool, beat: Synchronized[float]) -> None:
    import asyncio

    from cache_service.app import serve

    async def beating() -> None:
        while True:
            beat.value = time.monotonic()  # the host's clock: the supervisor reads the same one
            await asyncio.sleep(BEAT_S)

    logs.configure(log_format, verbose)
    asyncio.run(serve(config, beating))


@dataclass
class _Worker:
    """A started worker and its heartbeat (0 until it serves)."""

    proc: BaseProcess
    beat: Synchronized[float]

    def hung(self, now: float, hang_s: float) -> float | None:
        """Seconds since the last beat of a serving worker silent for ``hang_s`` or more."""
        last = self.beat.value
        return now - last if last and now - last >= hang_s else None


def serve_processes(
    config: AppConfig,
    processes: int,
    *,
    worker_ports: int | None = None,
    log_format: str = "text",
    verbose: bool = False,
    hang_s: float | None = None,
) -> None:
    """Run ``processes`` workers until SIGTERM or SIGINT; with ``worker_ports``, worker ``i``
    also serves port ``worker_ports + i`` alone. A serving worker silent for ``hang_s``
    (default :data:`HANG_S`) is killed and replaced."""
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    if config.server.port == 0 and processes > 1:
        raise ValueError("several processes need a fixed port to share")
    ports = check_ports(config, processes, worker_ports)
    hang_s = HANG_S if hang_s is None else hang_s
    check_files(config.server)  # a bad token or TLS file stops the start, not each worker
    stop = threading.Event()  # taken from the first moment: a stop during the start stops what it started
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    embedded = None
    url = config.redis_url
    if not url:
        embedded = EmbeddedRedis(config.embedded, avoid=ports).start()
        if stop.is_set():
            logger.info("stop asked while starting: no worker started")
            embedded.stop()
            return
        embedded.supervise()  # restarted when it dies: the workers' journals then drain
        url = embedded.url
        (config.embedded.data_dir / "url").write_text(url)
    ctx = mp.get_context("spawn")

    def start(i: int) -> _Worker:
        worker = worker_config(config, i, url, worker_ports)
        beat = ctx.Value("d", 0.0)
        proc = ctx.Process(target=_run, args=(worker, log_format, verbose, beat), name=f"worker-{i}")
        proc.start()
        logger.info("worker %d started (pid %s)", i, proc.pid)
        return _Worker(proc, beat)

    workers = [start(i) for i in range(processes)]
    try:
        while not stop.wait(RESTART_PAUSE_S):
            now = time.monotonic()
            for i, w in enumerate(workers):
                if not w.proc.is_alive():
                    logger.warning("worker %d (pid %s) exited with %s; restarting", i, w.proc.pid, w.proc.exitcode)
                    workers[i] = start(i)
                elif (silent := w.hung(now, hang_s)) is not None:
                    logger.error("worker %d (pid %s) has not served for %.0f s; killing it", i, w.proc.pid, silent)
                    w.proc.kill()  # SIGKILL ends a stopped process too
                    w.proc.join(10)
                    workers[i] = start(i)
    finally:
        for w in workers:
            w.proc.terminate()  # SIGTERM: each drains and stops on its own (one still starting too)
        deadline = time.monotonic() + stop_seconds(config.server.grace_s) + STOP_SLACK_S
        for w in workers:
            w.proc.join(max(0.0, deadline - time.monotonic()))
            if w.proc.is_alive():
                logger.error("%s (pid %s) still stopping past its time; killing it", w.proc.name, w.proc.pid)
                w.proc.kill()
                w.proc.join()
        if embedded is not None:
            embedded.stop()
