"""How many steps an engine's requests run, and so how many steps a draft model's read of a
request's prompt serves.

A draft model reads a request's prompt once (and a backlog once, after steps it skipped); every
later step of the request drafts from that read. So the read is worth what the model's chains
bring over the request's remaining steps, not over the one step that makes it. A proposer does
not know where a request will end (vLLM's does not see its ``max_tokens``, llama.cpp's not even
that a generation started), but it sees its engine's requests end: :class:`RequestSteps` keeps
the lengths, in steps, of the last ``keep`` that did, and expects a request that has run ``age``
steps to run as many more as those that ran longer than ``age`` did on average (their mean
residual life). Before any request has ended, or past the longest kept, it expects the step
being drafted and no more: a read then pays for itself in one step, as it did before requests
were counted.

>>> steps = RequestSteps()
>>> steps.remaining(0)  # nothing ended yet: this step only
1.0
>>> for n in (10, 20, 30):
...     steps.ended(n)
>>> steps.remaining(0), steps.remaining(15), steps.remaining(40)  # (10+20+30)/3; (5+15)/2; none ran so long
(20.0, 10.0, 1.0)
"""

from __future__ import annotations

import numpy as np


class RequestSteps:
    """The steps the last ``keep`` finished requests ran; see the module docstring."""

    def __init__(self, keep: int = 256) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self._lengths = np.zeros(keep, dtype=np.int64)
        self._count = 0  # requests ended so far (the ring holds the last ``keep``)

    def ended(self, steps: int) -> None:
        """A request ended after ``steps`` steps (one that ran none is not counted)."""
        if steps > 0:
            self._lengths[self._count % self._lengths.size] = steps
            self._count += 1

    def remaining(self, age: int) -> float:
        """The steps a request that has run ``age`` is expected to run from this one on, this one
        included: at least 1."""
        kept = self._lengths[: min(self._count, self._lengths.size)]
        longer = kept[kept > age]
        return float(longer.mean()) - age if longer.size else 1.0

    @property
    def count(self) -> int:
        """Requests that have ended."""
        return self._count
