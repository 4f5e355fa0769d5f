"""A first start's compilation shared among processes (cache_service.host.compile_ahead) and
the cache check it starts from (indexer.kernels.cache.holds): real numba, real processes, a
package of cached functions of its own in a temporary folder."""

from __future__ import annotations

import importlib
import logging
import os
import subprocess
import sys
from pathlib import Path

import numba
import pytest

from cache_service.host import compile_ahead
from indexer import kernels
from indexer.kernels.cache import holds

ROOT = Path(__file__).resolve().parents[2]

_MODULE = """
from numba import njit

@njit(cache=True)
def value():
    return {n}

@njit
def uncached():
    return 1

def warm():
    value()

def fail():
    raise RuntimeError("a share that fails")
"""


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module ``ahead_pkg_N.mod`` of cached functions, importable here and in child processes
    (spawned children take this process's ``sys.path``); its cache beside it."""
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    name = f"ahead_pkg_{os.getpid()}_{tmp_path.name}".replace("-", "_")
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "from pathlib import Path\nfrom indexer.kernels.cache import stamp_with_package\n"
        "stamp_with_package(Path(__file__).parent)\n"
    )
    (pkg / "mod.py").write_text(_MODULE.format(n=1))
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"{name}.mod"


def _in_a_process(module: str, code: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*sys.path])}
    env.pop("NUMBA_DISABLE_JIT", None)
    out = subprocess.run(
        [sys.executable, "-c", f"import {module} as m; {code}"],
        env=env, capture_output=True, text=True, check=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    return out.stdout.strip()


@pytest.mark.skipif(numba.config.DISABLE_JIT, reason="nothing is compiled with the JIT disabled")
def test_the_cache_holds_a_function_once_compiled_and_not_after_its_package_changed(package: str) -> None:
    mod = importlib.import_module(package)
    assert holds(mod.value) is False
    assert holds(mod.uncached) is None  # no cache to ask
    _in_a_process(package, "m.value()")
    assert holds(mod.value) is True
    folder = Path(mod.__file__).parent
    (folder / "mod.py").write_text(_MODULE.format(n=2))  # the package's digest changes
    importlib.invalidate_caches()
    assert _in_a_process(package, "from indexer.kernels.cache import holds; print(holds(m.value))") == "False"


@pytest.mark.skipif(numba.config.DISABLE_JIT, reason="nothing is compiled with the JIT disabled")
def test_shares_compile_in_processes_of_their_own_and_this_one_loads_what_they_compiled(package: str) -> None:
    mod = importlib.import_module(package)
    assert holds(mod.value) is False
    seconds = compile_ahead.compile_ahead((mod.warm,))
    assert seconds > 0
    assert holds(mod.value) is True
    assert mod.value() == 1
    assert mod.value.stats.cache_hits and not mod.value.stats.cache_misses  # loaded, not compiled here


@pytest.mark.skipif(numba.config.DISABLE_JIT, reason="nothing is compiled with the JIT disabled")
def test_a_share_that_fails_is_reported_and_leaves_its_part_to_start_up(
    package: str, caplog: pytest.LogCaptureFixture
) -> None:
    mod = importlib.import_module(package)
    with caplog.at_level(logging.WARNING, logger=compile_ahead.__name__):
        compile_ahead.compile_ahead((mod.fail, mod.warm))
    assert "compile-fail ended with 1" in caplog.text
    assert holds(mod.value) is True  # the other share still did its part


@pytest.mark.skipif(numba.config.DISABLE_JIT, reason="nothing is compiled with the JIT disabled")
def test_once_the_kernels_are_warm_a_start_needs_no_shared_compilation() -> None:
    kernels.warm_up()  # loads from the cache where an earlier test or start compiled them
    assert holds(kernels.draft_batch) is True
    assert holds(kernels.draft_chain_batch) is True
    assert compile_ahead.needed() is False
