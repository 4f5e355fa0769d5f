"""Returning freed heap memory to the operating system after a rebuild.

A rebuild allocates and frees hundreds of megabytes (the snapshot, the suffix array, the LCP
array, the log entries read back). glibc keeps freed heap pages for reuse, so without a trim a
process that built once looks (and, to a memory limit, is) hundreds of megabytes bigger.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable


def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:  # pragma: no cover - not a glibc system
        return None
    try:
        trim: Callable[[int], int] = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # pragma: no cover - musl and others have none
        return None
    return trim


_TRIM = _malloc_trim()


def release_free_memory() -> bool:
    """Give free heap pages back to the OS; False where the C library cannot."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True
