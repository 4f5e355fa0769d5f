"""Replaying through a running service: the same drafter protocol, over gRPC.

Each step sends the tokens produced since the previous draft in the draft call itself (so
contexts stay server-side and one round trip serves a step), exactly as a decoder does.
"""

from __future__ import annotations

import grpc
import numpy as np
from draftcache.v1 import draftcache_pb2 as pb
from draftcache.v1 import draftcache_pb2_grpc as pb_grpc

from decoder_client.client import tree_from_proto
from indexer.drafter import DraftParams
from indexer.tree_builder import DraftTree


class RemoteDrafter:
    """A replay drafter backed by a draftcache service at ``target`` (``host:port``)."""

    def __init__(self, target: str, namespace: str, params: DraftParams, *, timeout_s: float = 30.0) -> None:
        self.name = f"draftcache@{target}"
        self._channel = grpc.insecure_channel(target)
        self._stub = pb_grpc.DraftCacheStub(self._channel)
        self._namespace = namespace
        self._params = pb.DraftParams(
            budget=params.budget,
            max_depth=params.max_depth,
            min_score=params.min_score,
            depth_reserve=params.depth_reserve,
        )
        self._timeout = timeout_s
        self._sid = ""
        self._pending: list[int] = []

    def start(self, prompt: np.ndarray) -> None:
        req = pb.OpenSessionsRequest(
            sessions=[pb.OpenSession(namespace=self._namespace, prompt=prompt.tolist(), params=self._params)]
        )
        self._sid = self._stub.OpenSessions(req, timeout=self._timeout).session_ids[0]
        self._pending = []

    def propose(self) -> DraftTree:
        req = pb.DraftRequest(items=[pb.DraftItem(session_id=self._sid, new_tokens=self._pending)])
        self._pending = []
        return tree_from_proto(self._stub.Draft(req, timeout=self._timeout).trees[0])

    def advance(self, tokens: np.ndarray) -> None:
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
