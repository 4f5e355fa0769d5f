"""Arguments for compiled loops in one layout. A compiled loop is built once per argument
type, and numba tells a read-only array from a writable one: a loop warmed at start-up with
one and handed the other compiles again while serving. Callers whose arrays may be either
(a live index's are frozen, a fresh build's are not) pass read-only views."""

from __future__ import annotations

import numpy as np


def read_only(a: np.ndarray, dtype: type) -> np.ndarray:
    """``a`` as a C-contiguous, read-only array of ``dtype``: a view where it already is one
    (no copy), a converted copy otherwise.

    >>> a = np.arange(3, dtype=np.int32)
    >>> v = read_only(a, np.int32)
    >>> v.flags.writeable, np.shares_memory(v, a), a.flags.writeable
    (False, True, True)
    """
    out: np.ndarray = np.ascontiguousarray(a, dtype=dtype).view()
    out.flags.writeable = False
    return out
