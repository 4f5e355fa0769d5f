"""The draft client: what an inference server embeds to get draft trees from draftcache.

One batched call per decode step serves the whole batch; each session sends only the tokens
produced since its previous call. Every call has a deadline (a few milliseconds by default): if
the service is slow or down, the client answers from a local fallback drafter (prompt lookup
over the session's own context) instead, so decoding never waits on the cache. A session whose
server copy may have missed tokens (a call that failed midway) is re-opened with its full
context the next time the service answers.

Calls travel on two long-lived bidirectional streams per client (``stream=True``, the
default): a message on an open stream costs the service about half of what a unary call does.
Drafts have one to themselves; opens and closes share the other, so a long prompt
being indexed or a commit never holds up a draft queued behind it.

The package's parts: :mod:`~.config` (settings), :mod:`~.session` (one request's state),
:mod:`~.core` (bookkeeping and fallback drafts, no I/O), :mod:`~.plan` (a decode step's draft as
a sequence of I/O effects), :mod:`~.protocol`, :mod:`~.stream` and :mod:`~.aio_stream` (the
stream transports), :mod:`~.sync` and :mod:`~.aio` (the two clients, which only perform I/O).

>>> from decoder_client.client import ClientConfig, DraftClient
>>> client = DraftClient(ClientConfig(target="127.0.0.1:50051", namespace="llama2"))  # doctest: +SKIP
>>> (session,) = client.open([[1, 2, 3]])  # doctest: +SKIP
>>> (tree,) = client.draft([session], [[]])  # doctest: +SKIP
"""

from decoder_client.client.aio import AsyncDraftClient
from decoder_client.client.config import ClientConfig
from decoder_client.client.core import ClientStats, Fallback, prompt_lookup_fallback
from decoder_client.client.session import ClientSession, TopkAt
from decoder_client.client.sync import DraftClient
from decoder_client.wire import tree_from_proto

__all__ = [
    "AsyncDraftClient",
    "ClientConfig",
    "ClientSession",
    "ClientStats",
    "DraftClient",
    "Fallback",
    "TopkAt",
    "prompt_lookup_fallback",
    "tree_from_proto",
]
