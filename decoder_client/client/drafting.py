"""What an engine adapter calls of a client: the service's client and a near copy answer alike.

Sessions are opaque to the adapter: whatever ``open`` returned is handed back to ``draft``,
``add_tokens`` and ``close``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from decoder_client.client.config import ClientConfig
from decoder_client.client.core import ClientStats
from decoder_client.client.session import TopkRows
from indexer.tree_builder import DraftTree


class Drafting(Protocol):
    """A client an engine drafts with (:class:`~decoder_client.client.sync.DraftClient` or
    :class:`~decoder_client.client.near.NearClient`)."""

    @property
    def config(self) -> ClientConfig: ...

    @property
    def stats(self) -> ClientStats: ...

    def cut_chains_at(self, min_prob: float) -> None: ...

    def open(
        self, prompts: Sequence[Sequence[int] | np.ndarray], *, wait: bool = True, wait_s: float = 0.0
    ) -> Sequence[Any]: ...

    def draft(
        self,
        sessions: Sequence[Any],
        new_tokens: Sequence[Sequence[int]],
        topk: Sequence[TopkRows | None] | None = None,
        *,
        deadline_s: float | None = None,
    ) -> list[DraftTree]: ...

    def add_tokens(self, sessions: Sequence[Any], new_tokens: Sequence[Sequence[int]]) -> None: ...

    def close(self, sessions: Sequence[Any], *, commit: bool = True) -> None: ...

    def settle(self) -> None: ...

    def shutdown(self) -> None: ...
