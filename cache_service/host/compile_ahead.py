"""A first start's compilation shared among processes.

Start-up compiles every drafting kernel before it serves (:func:`cache_service.app.warm_up`);
numba caches the result, so later starts only load it. On a machine whose cache holds none of
it, one process compiles it all: over three minutes on two cores. Most of that is the draft step
(everything it calls is compiled into it) and the kernels no draft step calls (a rebuild's, a
verification outcome's), which share little. So on such a start two processes compile those two
side by side into the cache; start-up then loads them and compiles what is left (the chain
step, from the pieces the draft step compiled).

Nothing here is needed for correctness: a share that fails or is killed leaves start-up to
compile its kernels itself, as it would have (the child's traceback goes to standard error).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable

from indexer import kernels
from indexer.kernels.cache import holds

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def needed() -> bool:
    """Whether the cache lacks the draft step: a first start here (or after a change to the
    kernels), where sharing the compilation pays. Not where that cannot be told, nor on one core."""
    return (os.cpu_count() or 1) > 1 and holds(kernels.draft_batch) is False


def compile_ahead(shares: tuple[Callable[[], None], ...]) -> float:
    """Run each of ``shares`` (functions a child process can import by name) in a process of
    its own, all at once, and wait for them; the seconds it took. A start that ends meanwhile
    ends them too: at its exit (they are daemons) and, on Linux, at its ``os._exit`` or its
    death (:func:`_die_with`)."""
    start = time.monotonic()
    ctx = mp.get_context("spawn")  # the caller has threads: no fork
    procs = [
        ctx.Process(target=_share, args=(share, os.getpid()), name=f"compile-{share.__name__}", daemon=True)
        for share in shares
    ]
    for proc in procs:
        try:
            proc.start()
        except OSError as exc:  # no process to be had (limits, memory): start-up compiles it all
            logger.warning("%s could not start (%s): start-up compiles its part", proc.name, exc)
    for proc in procs:
        if proc.pid is None:
            continue
        proc.join()
        if proc.exitcode != 0:
            logger.warning("%s ended with %s: start-up compiles its part", proc.name, proc.exitcode)
    return time.monotonic() - start


def _share(share: Callable[[], None], parent: int) -> None:
    """A share's process: it ends with ``parent``, then compiles."""
    _die_with(parent)
    share()


def _die_with(parent: int) -> None:
    """Have the kernel kill this process when the thread that started it ends (Linux's
    ``PR_SET_PDEATHSIG``): a start ended with ``os._exit``, or killed, leaves no compilation
    behind. Elsewhere a share runs to its end. A parent already gone ends it now."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)
