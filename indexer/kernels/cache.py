"""numba's on-disk cache, kept fresh across the kernel modules.

numba checks a cached function against its own source file only. The kernels call each other
across modules: the draft step is compiled into one piece of machine code with the merge, the
searches and the tables. So a change to ``tree.py`` alone would leave the cached draft step
running the old merge, silently, until ``draft.py`` changed too. :func:`stamp_with_package`
makes the cache entry of every compiled function in a package directory carry a digest of all
the package's modules as well: a change to any of them recompiles each of its functions once.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

from numba.core import caching

_PACKAGES: set[Path] = set()


@functools.cache
def sources_digest(directory: Path) -> bytes:
    """SHA-256 over the names and contents of the ``*.py`` files in ``directory``, in name order."""
    digest = hashlib.sha256()
    for path in sorted(directory.glob("*.py")):
        digest.update(path.name.encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.digest()


class _PackageStamped:
    """A numba cache locator for a function of a stamped package: its own file's stamp, then
    the package's :func:`sources_digest`. Functions elsewhere are left to numba's locators."""

    _py_file: str

    def get_source_stamp(self) -> Any:
        own = super().get_source_stamp()  # type: ignore[misc]
        return own, sources_digest(Path(self._py_file).resolve().parent)

    @classmethod
    def from_function(cls, py_func: Any, py_file: str) -> Any:
        if Path(py_file).resolve().parent not in _PACKAGES:
            return None
        return super().from_function(py_func, py_file)  # type: ignore[misc]


def _numba_locator(name: str) -> type:
    """One of numba's locator classes (numba < 0.62 names them with a leading underscore)."""
    found = getattr(caching, name, None) or getattr(caching, "_" + name)
    assert isinstance(found, type)
    return found


# Where numba itself would cache: the user's NUMBA_CACHE_DIR, beside the module, the user's cache.
_LOCATORS = [
    type(f"PackageStamped{name}", (_PackageStamped, _numba_locator(name)), {})
    for name in ("UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator")
]


def stamp_with_package(directory: Path) -> None:
    """Stamp the cache entries of the compiled functions defined in ``directory`` with
    :func:`sources_digest` of it. Call before those functions are defined (their cache is
    located when they are decorated). Entries cached before carry another stamp and are
    compiled again once."""
    _PACKAGES.add(directory.resolve())
    impl: Any = caching.CacheImpl  # its _locator_classes: numba's locators, tried in order
    classes = impl._locator_classes
    if classes[: len(_LOCATORS)] != _LOCATORS:
        classes[:0] = _LOCATORS


stamp_with_package(Path(__file__).parent)  # the kernels themselves, defined after this module


def holds(dispatcher: Any) -> bool | None:
    """Whether numba's cache holds code of the compiled function ``dispatcher``, for these
    sources and this CPU (for any argument types); ``None`` where that cannot be told (no
    cache for it, the JIT disabled, a numba whose cache reads otherwise)."""
    try:
        index = dispatcher._cache._cache_file._load_index()
        magic = dispatcher.targetctx.codegen().magic_tuple()
    except Exception:  # numba's own layout, not an API: unknown is not an answer
        return None
    return any(key[1] == magic for key in index)
