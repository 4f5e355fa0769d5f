"""Replaying through a running service: the same drafter protocol, over gRPC.

Each step sends the tokens produced since the previous draft in the draft call itself (so
contexts stay server-side and one round trip serves a step), exactly as a decoder does. With
``lookahead`` each call also drafts ahead for that many outcomes of the tree it returns; when the
next step's tokens are an outcome drafted ahead for, the service answers with that tree (the
subtree it selects), as the engine in process does. Drafting ahead happens inside the call here,
so its time counts in the call's.
"""

from __future__ import annotations

import grpc
import numpy as np
from draftcache.v1 import draftcache_pb2 as pb
from draftcache.v1 import draftcache_pb2_grpc as pb_grpc

from decoder_client.client import tree_from_proto
from decoder_client.wire import params_to_proto, prefetched_from_response
from indexer.drafter import DraftParams
from indexer.prespeculation import Prefetched, select
from indexer.tree_builder import DraftTree

_NO_ROWS = np.zeros((0, 1), dtype=np.int32)


class RemoteDrafter:
    """A replay drafter backed by a draftcache service at ``target`` (``host:port``)."""

    def __init__(
        self, target: str, namespace: str, params: DraftParams, *, timeout_s: float = 30.0, lookahead: int = 0
    ) -> None:
        self.name = f"draftcache@{target}"
        self.lookahead = lookahead  # outcomes drafted ahead per step (0: no pre-speculation)
        self.last_was_ahead = False
        self.ahead: Prefetched = {}  # what the service drafted ahead for the tree last proposed
        self._channel = grpc.insecure_channel(target)
        self._stub = pb_grpc.DraftCacheStub(self._channel)
        self._namespace = namespace
        self._params = params_to_proto(params)
        self._timeout = timeout_s
        self._sid = ""
        self._pending: list[int] = []
        self._pending_topk = _NO_ROWS  # top-k rows of the pending tokens (none: empty)

    def start(self, prompt: np.ndarray) -> None:
        req = pb.OpenSessionsRequest(
            sessions=[pb.OpenSession(namespace=self._namespace, prompt=prompt.tolist(), params=self._params)]
        )
        self._sid = self._stub.OpenSessions(req, timeout=self._timeout).session_ids[0]
        self._pending, self.ahead, self._pending_topk = [], {}, _NO_ROWS

    def propose(self) -> DraftTree:
        # The service goes on with a tree drafted ahead when these tokens are its outcome.
        self.last_was_ahead = bool(self._pending) and select(self.ahead, self._pending) is not None
        rows = self._pending_topk if self._pending_topk.shape[0] == len(self._pending) else None
        item = pb.DraftItem(
            session_id=self._sid,
            new_tokens=self._pending,
            lookahead=self.lookahead,
            topk=[] if rows is None else rows.ravel().tolist(),
            topk_k=0 if rows is None else rows.shape[1],
        )
        self._pending, self._pending_topk = [], _NO_ROWS
        resp = self._stub.Draft(pb.DraftRequest(items=[item]), timeout=self._timeout)
        self.ahead = prefetched_from_response(resp)[0] if len(resp.prefetched) else {}
        return tree_from_proto(resp.trees[0])

    def draft_ahead(self) -> None:
        """Nothing to do: the draft call drafted ahead already."""

    def advance(self, tokens: np.ndarray, topk: np.ndarray | None = None) -> None:
        """The step's tokens, sent with the next draft call, with their top-k rows if given."""
        if topk is not None:
            if self._pending_topk.size and len(self._pending):  # rows of earlier tokens came before
                topk = np.concatenate((self._pending_topk, topk))
            self._pending_topk = topk
        self._pending.extend(tokens.tolist())

    def finish(self, commit_from: int) -> None:
        if self._pending:  # the last step's tokens belong to the request too
            self._stub.Feedback(
                pb.FeedbackRequest(items=[pb.FeedbackItem(session_id=self._sid, accepted=self._pending)]),
                timeout=self._timeout,
            )
            self._pending = []
        req = pb.CloseSessionsRequest(
            sessions=[pb.CloseSession(session_id=self._sid, commit=True, commit_from=commit_from)]
        )
        self._stub.CloseSessions(req, timeout=self._timeout)

    def close(self) -> None:
        self._channel.close()
