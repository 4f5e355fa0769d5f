"""The compiled-code cache follows changes across kernel modules (indexer.kernels.cache)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import indexer.kernels
from indexer.kernels import cache as kcache
from indexer.kernels import draft, tree

ROOT = Path(__file__).resolve().parents[2]

# A package of two cached modules: outer.value() is compiled with inner.value() inside it.
_INIT = """
from pathlib import Path
{stamp}
"""
_STAMP = "from indexer.kernels.cache import stamp_with_package\nstamp_with_package(Path(__file__).parent)"
_OUTER = """
from numba import njit
from {pkg}.inner import value as inner_value

@njit(cache=True)
def value():
    return inner_value() * 10
"""
_INNER = """
from numba import njit

@njit(cache=True)
def value():
    return {n}
"""


def _package(root: Path, name: str, *, stamped: bool) -> Path:
    pkg = root / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text(_INIT.format(stamp=_STAMP if stamped else ""))
    (pkg / "outer.py").write_text(_OUTER.format(pkg=name))
    (pkg / "inner.py").write_text(_INNER.format(n=1))
    return pkg


def _value(root: Path, name: str) -> int:
    """outer.value() in a fresh process (so the answer comes from the on-disk cache)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(ROOT)])}
    env.pop("NUMBA_CACHE_DIR", None)
    env.pop("NUMBA_DISABLE_JIT", None)
    out = subprocess.run(
        [sys.executable, "-c", f"from {name}.outer import value; print(value())"],
        env=env, capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    return int(out.stdout.strip())


@pytest.mark.parametrize("stamped", [True, False])
def test_a_change_to_a_called_module_recompiles_its_callers(tmp_path: Path, stamped: bool) -> None:
    name = "stamped_pkg" if stamped else "plain_pkg"
    pkg = _package(tmp_path, name, stamped=stamped)
    assert _value(tmp_path, name) == 10
    assert any(pkg.glob("__pycache__/outer.value-*.nbi"))  # outer.value came from the cache next time
    (pkg / "inner.py").write_text(_INNER.format(n=2))
    # numba alone checks outer.value against outer.py only, and runs the old inner.value; with
    # the package stamped, any module's change recompiles it.
    assert _value(tmp_path, name) == (20 if stamped else 10)


def test_sources_digest_covers_every_module_by_name_and_content(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    (tmp_path / "notes.txt").write_text("not a module\n")
    first = kcache.sources_digest.__wrapped__(tmp_path)
    (tmp_path / "notes.txt").write_text("changed\n")
    assert kcache.sources_digest.__wrapped__(tmp_path) == first
    (tmp_path / "b.py").write_text("y = 3\n")
    changed = kcache.sources_digest.__wrapped__(tmp_path)
    assert changed != first
    (tmp_path / "b.py").rename(tmp_path / "c.py")
    assert kcache.sources_digest.__wrapped__(tmp_path) != changed


def test_the_kernels_are_stamped_with_their_package() -> None:
    kernels_dir = Path(indexer.kernels.__file__).resolve().parent
    for fn in (draft.draft_batch, tree.merge_tree):
        locator = fn._cache._impl.locator
        assert isinstance(locator, kcache._PackageStamped)
        _own, digest = locator.get_source_stamp()
        assert digest == kcache.sources_digest(kernels_dir)
