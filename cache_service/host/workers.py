"""Several server processes on one port, one per core: ``draftcache serve --processes N``.

Python serves one core per process, so a host runs several. They share the port (the kernel
spreads connections over them, ``SO_REUSEPORT``: by a hash of each connection's addresses, so a
few long-lived connections can pile onto one worker) and one Redis. With ``--worker-ports BASE``
worker ``i`` also serves ``BASE + i`` alone, for clients that place themselves (one decoder per
worker, say). Each worker follows the same lifetime log, and a session opened in one continues
in another from its stored copy. The supervisor starts the embedded Redis when no URL is given,
restarts a worker that dies, and on SIGTERM or SIGINT stops them all gracefully. Static priors
and lifetime indexes, the largest things a process holds, are written once into shared folders
and memory-mapped by every worker (one worker at a time builds the lifetime indexes:
:mod:`cache_service.host.shared_indexes`).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import threading
from dataclasses import replace
from multiprocessing.process import BaseProcess

from cache_service import logs
from cache_service.app import AppConfig
from cache_service.host.embedded_redis import EmbeddedRedis
from cache_service.rpc.server import check_files

logger = logging.getLogger(__name__)

RESTART_PAUSE_S = 1.0  # between a worker's death and its replacement


def worker_config(config: AppConfig, index: int, redis_url: str, worker_ports: int | None = None) -> AppConfig:
    """Worker ``index``'s configuration: the shared Redis, its own metrics port if any, its own
    serving port ``worker_ports + index`` if asked, and one folder each of memory-mapped priors
    and lifetime indexes for all, and a commit journal of its own in the common journal folder."""
    metrics = None if config.metrics_port is None else config.metrics_port + index
    prior_dir = config.prior_dir or config.embedded.data_dir.parent / "priors"
    lifetime_dir = config.lifetime_dir or config.embedded.data_dir.parent / "lifetime"
    server = config.server if worker_ports is None else replace(config.server, own_port=worker_ports + index)
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


def _run(config: AppConfig, log_format: str, verbose: bool) -> None:
    import asyncio

    from cache_service.app import serve

    logs.configure(log_format, verbose)
    asyncio.run(serve(config))


def serve_processes(
    config: AppConfig,
    processes: int,
    *,
    worker_ports: int | None = None,
    log_format: str = "text",
    verbose: bool = False,
) -> None:
    """Run ``processes`` workers until SIGTERM or SIGINT; with ``worker_ports``, worker ``i``
    also serves port ``worker_ports + i`` alone."""
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    if config.server.port == 0 and processes > 1:
        raise ValueError("several processes need a fixed port to share")
    ports = check_ports(config, processes, worker_ports)
    check_files(config.server)  # a bad token or TLS file stops the start, not each worker
    embedded = None
    url = config.redis_url
    if not url:
        embedded = EmbeddedRedis(config.embedded, avoid=ports).start()
        embedded.supervise()  # restarted when it dies: the workers' journals then drain
        url = embedded.url
        (config.embedded.data_dir / "url").write_text(url)
    ctx = mp.get_context("spawn")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())

    def start(i: int) -> BaseProcess:
        worker = worker_config(config, i, url, worker_ports)
        proc = ctx.Process(target=_run, args=(worker, log_format, verbose), name=f"worker-{i}")
        proc.start()
        logger.info("worker %d started (pid %s)", i, proc.pid)
        return proc

    workers = [start(i) for i in range(processes)]
    try:
        while not stop.wait(RESTART_PAUSE_S):
            for i, proc in enumerate(workers):
                if not proc.is_alive():
                    logger.warning("worker %d (pid %s) exited with %s; restarting", i, proc.pid, proc.exitcode)
                    workers[i] = start(i)
    finally:
        for proc in workers:
            proc.terminate()  # SIGTERM: each drains and stops on its own
        for proc in workers:
            proc.join(config.server.grace_s + 30)
            if proc.is_alive():
                proc.kill()
        if embedded is not None:
            embedded.stop()
