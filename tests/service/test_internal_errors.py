"""A bug inside the service answers INTERNAL with its traceback logged; it is never passed off
as the caller's mistake (an unexpected ValueError included)."""

from __future__ import annotations

import logging

import grpc
import pytest
from draftcache.v1 import draftcache_pb2 as pb

from tests.service.conftest import Running


def _broken(*args: object, **kwargs: object) -> None:
    raise ValueError("an index went out of step")  # as a bug inside the service would


def test_a_bug_in_a_handler_is_internal_and_logged(
    running: Running, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    running.admin.CreateNamespace(pb.CreateNamespaceRequest(name="toy", vocab_size=100))
    monkeypatch.setattr(running.service, "draft_ahead", _broken)
    req = pb.DraftRequest(items=[pb.DraftItem(session_id="s", new_tokens=[1])])
    with caplog.at_level(logging.ERROR, logger="cache_service.rpc.interceptor"), pytest.raises(grpc.RpcError) as err:
        running.stub.Draft(req)
    assert err.value.code() is grpc.StatusCode.INTERNAL
    assert "out of step" not in (err.value.details() or "")  # the client learns only that it failed
    (record,) = [r for r in caplog.records if r.name == "cache_service.rpc.interceptor"]
    assert record.exc_info is not None and record.exc_info[0] is ValueError
    assert "_broken" in caplog.text  # the traceback, down to where it was raised


def test_a_bug_on_a_stream_is_internal_and_the_stream_goes_on(
    running: Running, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    running.admin.CreateNamespace(pb.CreateNamespaceRequest(name="toy", vocab_size=100))
    monkeypatch.setattr(running.service, "feedback", _broken)
    feedback = pb.FeedbackRequest(items=[pb.FeedbackItem(session_id="s", accepted=[1])])
    opened = pb.OpenSessionsRequest(sessions=[pb.OpenSession(namespace="toy", prompt=[1, 2])])
    requests = [pb.StreamRequest(request_id=1, feedback=feedback), pb.StreamRequest(request_id=2, open=opened)]
    with caplog.at_level(logging.ERROR):
        first, second = list(running.stub.Stream(iter(requests)))
    assert first.error.code == grpc.StatusCode.INTERNAL.value[0]
    assert len(second.open.session_ids) == 1
    assert any(r.exc_info is not None and r.exc_info[0] is ValueError for r in caplog.records)
