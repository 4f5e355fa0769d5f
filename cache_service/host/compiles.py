"""Compilations while serving, logged and counted.

Start-up compiles (or loads from numba's cache) every compiled loop the service runs. One
compiled later holds the interpreter lock while numba works (seconds; tens on a fresh machine),
so the serving loop and every call on it wait that long: each such compilation is a warning
naming the function, and ``draftcache_compiles_while_serving_total`` counts them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from numba.core import event

logger = logging.getLogger(__name__)

KIND = "numba:compile"


class CompileWatch(event.Listener):
    """Between :meth:`start` and :meth:`stop`, each compilation numba finishes is logged (with
    its seconds) and ``observe`` is called. Compilations nest (a function compiles what it
    calls, numba runs one at a time): the outermost one stands for them all."""

    def __init__(self, observe: Callable[[], None] | None = None) -> None:
        self.compiled: list[str] = []  # each as module.function(argument types)
        self._observe = observe
        self._started: list[float] = []
        self._watching = False

    def start(self) -> None:
        if not self._watching:
            event.register(KIND, self)
            self._watching = True

    def stop(self) -> None:
        if self._watching:
            event.unregister(KIND, self)
            self._watching = False

    def on_start(self, ev: event.Event) -> None:
        self._started.append(time.perf_counter())

    def on_end(self, ev: event.Event) -> None:
        seconds = time.perf_counter() - self._started.pop() if self._started else 0.0
        if self._started:  # part of the compilation of what called it
            return
        func = ev.data["dispatcher"].py_func
        name = f"{func.__module__}.{func.__qualname__}{ev.data['args']}"
        self.compiled.append(name)
        logger.warning("compiled %s while serving (%.2f s, calls waited): warm-up does not cover it", name, seconds)
        if self._observe is not None:
            self._observe()
