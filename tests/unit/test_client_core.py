"""The client core's booking of calls that ended in the background: re-opens, and calls
drafting ahead that missed the next step's deadline. No server, no transport."""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import pytest
from draftcache.v1 import draftcache_pb2 as pb

from decoder_client.client import ClientConfig, ClientSession, TopkAt, prompt_lookup_fallback
from decoder_client.client.core import ClientCore
from indexer.drafter import DraftParams


def _core(*, stream: bool = True, late_before_skip: int = 2) -> ClientCore:
    config = ClientConfig(target="unused", namespace="ns", stream=stream, late_before_skip=late_before_skip)
    return ClientCore(config, prompt_lookup_fallback)


def _remote(context: list[int], server_id: str) -> ClientSession:
    s = ClientSession(context, len(context))
    s.server_id = server_id
    return s


def test_a_reopen_covers_sessions_without_a_copy_and_keeps_later_tokens_pending() -> None:
    core = _core()
    kept, lost = _remote([1, 2], "a"), ClientSession([3, 4, 5], 2)  # lost: decoded past its prompt
    opening = core.reopen_request([kept, lost])
    assert opening is not None and opening.sessions == [lost] and opening.sizes == [3]
    assert [list(o.prompt) for o in opening.request.sessions] == [[3, 4, 5]]
    lost.extend([6])  # produced while the open was under way
    core.opened(opening.sessions, pb.OpenSessionsResponse(session_ids=["b"]), opening.sizes)
    assert lost.server_id == "b" and lost.pending == [6]
    assert core.stats.reopened == 1  # opened with more than its prompt
    assert core.reopen_request([kept, lost]) is None  # nothing left to open


def test_a_late_call_drafting_ahead_on_a_stream_is_kept() -> None:
    core = _core(stream=True)
    s = _remote([1, 2], "a")
    s.extend([3])
    s.asked_at = len(s)  # the call carries the token 3 ...
    s.extend([4])  # ... and a last step's token is recorded after it was made
    call = object()
    assert core.ahead_late([([s], call)]) == []  # the caller keeps it under way
    assert s.server_id == "a" and s.pending == [4] and core.late == [([(s, "a")], call)]
    assert core.stats.failures == 1 and core.available()  # one late answer: the service is asked again
    assert core.ahead_late([([s], object())]) == []  # a second in a row: skipped a while
    assert core.stats.failures == 2 and not core.available()


def test_the_late_parts_of_one_step_count_as_one_late_answer() -> None:
    core = _core(stream=True)
    a, b = _remote([1, 2], "a"), _remote([3, 4], "b")
    calls = [([a], object()), ([b], object())]  # a batch over max_batch drafted ahead in two parts
    assert core.ahead_late(calls) == []  # both kept under way
    assert core.available() and len(core.late) == 2  # one late answer: the service is asked again


def test_opens_go_in_parts_of_max_batch_and_a_reopen_carries_one_part() -> None:
    config = ClientConfig(target="unused", namespace="ns", max_batch=2)
    core = ClientCore(config, prompt_lookup_fallback)
    sessions = [ClientSession([i, i + 1], 2) for i in range(5)]
    parts = core.open_parts(sessions)
    assert [len(req.sessions) for _, req in parts] == [2, 2, 1]
    assert [part for part, _ in parts] == [sessions[:2], sessions[2:4], sessions[4:]]
    opening = core.reopen_request(sessions)
    assert opening is not None and opening.sessions == sessions[:2]  # the rest go with the next one


def test_a_late_unary_call_drafting_ahead_is_given_up_on() -> None:
    core = _core(stream=False)
    s = _remote([1, 2], "a")
    call = object()
    assert core.ahead_late([([s], call)]) == [call]  # the caller cancels it
    # It may or may not have reached the service: the copy is closed, the session re-opened.
    assert s.server_id == "" and core.abandoned == ["a"] and core.late == []


class _Refused(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


def test_a_close_sent_while_the_service_is_skipped_and_its_commit_kept_when_it_fails() -> None:
    core = _core()
    s = _remote([1, 2], "a")
    s.extend([9])
    core.failed(None)  # two missed deadlines in a row: the service is skipped, yet a close costs nothing
    core.failed(None)
    close = core.close_request([s], commit=True)
    assert close is not None and [(c.session_id, c.commit, list(c.new_tokens)) for c in close.sessions] == [
        ("a", True, [9])
    ]
    assert s.server_id == "" and core.commits.unsent == 1
    core.close_settled(close, _Refused(grpc.StatusCode.UNAVAILABLE))
    assert core.abandoned == ["a"] and core.stats.commits_retried == 1 and len(core.commits) == 1
    core.down_until = 0.0  # the service answers again: the request is opened whole, then closed with commit
    opening = core.reopen_request([])
    assert opening is not None and [list(o.prompt) for o in opening.request.sessions] == [[1, 2, 9]]
    core.opened(opening.sessions, pb.OpenSessionsResponse(session_ids=["b"]), opening.sizes)
    commit = core.commit_request()
    assert commit is not None and [(c.session_id, c.commit, list(c.new_tokens)) for c in commit.sessions] == [
        ("b", True, [])
    ]
    core.close_settled(commit, None)
    assert core.commits.unsent == 0 and core.stats.commits_dropped == 0


def test_a_request_keeps_one_commit_key_through_every_retry() -> None:
    """The close with commit names the request's commit with a key; the retry of a close that
    failed (its answer lost, perhaps after it landed) names it with the same, and the service
    appends it once. Another request, or one committed whole, has a key of its own; a close
    without commit names none."""
    core = _core()
    s, other = _remote([1, 2], "a"), _remote([3, 4], "b")
    close = core.close_request([s, other], commit=True)
    assert close is not None
    key, other_key = (c.commit_key for c in close.sessions)
    assert re.fullmatch("[0-9a-f]{32}", key) and key != other_key
    core.close_settled(close, _Refused(grpc.StatusCode.DEADLINE_EXCEEDED))
    for server_id in ("c", "d"):  # the retry fails too, then lands
        core.down_until = 0.0
        opening = core.reopen_request([])
        assert opening is not None
        core.opened(opening.sessions, pb.OpenSessionsResponse(session_ids=[server_id, server_id + "2"]), opening.sizes)
        commit = core.commit_request()
        assert commit is not None and [c.commit_key for c in commit.sessions] == [key, other_key]
        core.close_settled(commit, _Refused(grpc.StatusCode.UNAVAILABLE) if server_id == "c" else None)
    assert core.commits.unsent == 0
    lost = ClientSession([5, 6], 1)  # ended without a copy: kept with a key from the start
    assert core.close_request([lost], commit=True) is None and lost.commit_key not in ("", key, other_key)
    assert [w.commit_key for w in core.commits.to_open()] == [lost.commit_key]
    core.keep_for_commit([7, 8], retry=False)  # a whole request committed (a near copy's)
    assert len({w.commit_key for w in core.commits.to_open()}) == 2
    plain = core.close_request([_remote([9], "e")], commit=False)
    assert plain is not None and plain.sessions[0].commit_key == ""


def test_a_request_ended_without_a_copy_is_kept_and_one_the_service_refuses_is_dropped() -> None:
    core = _core()
    ended = ClientSession([1, 2, 3], 2)  # its copy was lost (or never opened)
    assert core.close_request([ended], commit=True) is None and len(core.commits) == 1
    assert core.close_request([ClientSession([4], 1)], commit=False) is None and len(core.commits) == 1
    opening = core.reopen_request([])
    assert opening is not None
    core.open_failed(opening.request, _Refused(grpc.StatusCode.INVALID_ARGUMENT), opening.sessions)
    assert core.commits.unsent == 0 and core.stats.commits_dropped == 1  # it would be refused every time
    s = _remote([5], "c")
    close = core.close_request([s], commit=True)
    assert close is not None
    core.close_settled(close, _Refused(grpc.StatusCode.PERMISSION_DENIED))
    assert core.commits.unsent == 0 and core.stats.commits_dropped == 2


def test_a_long_outage_keeps_bounded_calls_and_ids_to_close() -> None:
    """Requests keep ending while every background open fails: each open carries at most a
    service's least batch of them, and the copies given up on are bounded too (the oldest
    expire on the service), and closed a batch at a time once it answers."""
    core = _core()
    for i in range(3000):
        core.keep_for_commit([i % 100] * 20, retry=False)
        opening = core.reopen_request([], now=True)
        assert opening is not None and len(opening.request.sessions) <= 64
        core.open_failed(opening.request, _Refused(grpc.StatusCode.UNAVAILABLE), opening.sessions)
    assert len(core.abandoned) == 1 << 14
    close = core.abandoned_request(now=True)
    assert close is not None and len(close.sessions) == 64 and len(core.abandoned) == (1 << 14) - 64


def test_the_service_is_skipped_after_an_error_or_misses_in_a_row() -> None:
    core = _core()
    s = _remote([1, 2], "a")
    core.failed(None)  # a late answer ...
    assert core.available() and core.late_run == 1
    core.answered([s], pb.DraftResponse())  # ... then one in time: the row is broken
    assert core.late_run == 0
    core.failed(None)
    assert core.available()  # one miss since the answer: asked again
    core.failed(None)
    assert not core.available()  # two in a row
    core.down_until = 0.0
    core.answered([s], pb.DraftResponse())
    core.failed(_Refused(grpc.StatusCode.UNAVAILABLE))  # an error: skipped at once
    assert not core.available() and core.stats.failures == 4


def test_late_before_skip_is_checked() -> None:
    with pytest.raises(ValueError, match="late_before_skip"):
        ClientConfig(target="unused", namespace="ns", late_before_skip=0)
    core = _core(late_before_skip=1)
    core.failed(None)
    assert not core.available()  # 1: every miss skips the service, as an error does


@pytest.mark.parametrize("token", ["tok\n", "t\u00f6k", "tok\tab"])
def test_a_token_grpc_cannot_send_is_refused_without_echoing_it(token: str) -> None:
    with pytest.raises(ValueError, match="token must be printable ASCII") as refused:
        ClientConfig(target="unused", namespace="ns", token=token)
    assert token not in str(refused.value)
    assert ClientConfig(target="unused", namespace="ns", token="tok-a b.c=").token == "tok-a b.c="


def test_tls_files_that_hold_no_pem_block_of_their_kind_are_refused_naming_them(tmp_path: Path) -> None:
    """gRPC takes any bytes as a certificate and fails every handshake: the client says which
    file is wrong when it is made, instead of drafting locally for good."""
    cert, key, junk = tmp_path / "ca.pem", tmp_path / "key.pem", tmp_path / "junk.pem"
    cert.write_bytes(b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    key.write_bytes(b"-----BEGIN EC PRIVATE KEY-----\nMHc\n-----END EC PRIVATE KEY-----\n")
    junk.write_bytes(b"not a certificate")

    def tls(**files: Path) -> None:
        ClientConfig(target="unused", namespace="ns", **{k: str(v) for k, v in files.items()}).credentials()

    with pytest.raises(ValueError, match=re.escape(f"tls_root_cert_file: {junk} holds no PEM certificate")):
        tls(tls_root_cert_file=junk)
    with pytest.raises(ValueError, match=r"tls_root_cert_file: .* holds no PEM certificate"):
        tls(tls_root_cert_file=key)  # the key where the CA goes
    with pytest.raises(ValueError, match=r"tls_key_file: .* holds no PEM private key"):
        tls(tls_root_cert_file=cert, tls_cert_file=cert, tls_key_file=cert)
    with pytest.raises(ValueError, match=re.escape(f"tls_root_cert_file: cannot read {tmp_path / 'gone.pem'}")):
        tls(tls_root_cert_file=tmp_path / "gone.pem")


@pytest.mark.parametrize("columns", [True, False], ids=["columns", "items"])
def test_topk_rows_go_in_the_form_every_service_reads_unless_they_name_their_tokens(columns: bool) -> None:
    config = ClientConfig(target="unused", namespace="ns", topk=2)
    core = ClientCore(config, prompt_lookup_fallback)
    core.columns = columns
    plain, other = _remote([1, 2], "a"), _remote([5, 6], "b")
    core.add_tokens([plain, other], [[3, 4], [7]], [[[3, 9], [4, 9]], None])
    req = core.draft_request([plain, other])
    assert req is not None
    if columns:  # a row per new token, -1 rows for a session without: no positions named
        c = req.columns
        assert list(c.topk) == [3, 9, 4, 9, -1, -1] and c.topk_k == 2
        assert not c.topk_after and not c.topk_counts
    else:
        a, b = req.items
        assert list(a.topk) == [3, 9, 4, 9] and a.topk_k == 2 and not a.topk_after
        assert not b.topk and b.topk_k == 0
    # Rows at every verified node name the token each follows (50: a rejected node); a session
    # whose rows follow its new tokens is named too where the batch names any.
    plain.heard(), other.heard()  # the service answered
    core.add_tokens([plain, other], [[5], [8]], [TopkAt([4, 50], [[5, 1], [51, 52]]), [[8, 1]]])
    req = core.draft_request([plain, other])
    assert req is not None
    if columns:
        c = req.columns
        assert list(c.topk_after) == [4, 50, 7] and list(c.topk_counts) == [2, 1]
        assert list(c.topk) == [5, 1, 51, 52, 8, 1]
    else:
        a, b = req.items
        assert list(a.topk_after) == [4, 50] and list(a.topk) == [5, 1, 51, 52]
        assert not b.topk_after and list(b.topk) == [8, 1]


def _tree(tokens: list[int], parents: list[int]) -> pb.Tree:
    return pb.Tree(tokens=tokens, parents=parents, sources=bytes(len(tokens)), scores=[0.5] * len(tokens))


def test_a_malformed_tree_from_the_service_is_not_used() -> None:
    """Trees with an id outside the vocabulary, a parent that is not an earlier node, or more
    nodes than the chain asked for: those sequences draft locally, the others use theirs."""
    config = ClientConfig(target="unused", namespace="ns", params=DraftParams(chain=4), vocab_size=50)
    core = ClientCore(config, prompt_lookup_fallback)
    good = _tree([7, 8], [-1, 0])
    bad = [
        _tree([7, 50], [-1, 0]),  # past the vocabulary
        _tree([-7], [-1]),
        _tree([7, 8], [-1, 1]),  # its own parent
        _tree([7, 8], [-1, 40]),
        _tree([7, 8, 9, 10, 11], [-1, 0, 1, 2, 3]),  # a chain of 5 where 4 were asked
    ]
    for tree in bad:
        sessions = [_remote([1, 2, 3, 1, 2], "a"), _remote([4, 5, 6], "b")]
        trees = core.trees(sessions, pb.DraftResponse(trees=[tree, good]))
        assert trees[1].tokens.tolist() == [7, 8]
        assert all(0 <= t < 50 for t in trees[0].tokens.tolist()) and trees[0].tokens.tolist() != tree.tokens
        assert sessions[0].chain is None or sessions[0].chain.tokens.size == 0  # not continued from
    assert core.stats.malformed == len(bad) and core.stats.fallback == len(bad) and core.stats.remote == len(bad)
    # Fields that disagree in length: no answer at all, every sequence drafts locally.
    torn = pb.Tree(tokens=[7, 8], parents=[-1], sources=b"\0\0", scores=[0.5, 0.5])
    trees = core.trees([_remote([1, 2], "a")], pb.DraftResponse(trees=[torn]))
    assert core.stats.fallback == len(bad) + 1 and core.columns


def test_a_malformed_tree_drafted_ahead_is_left_out() -> None:
    """A tree drafted ahead whose parent points past it (a kernel would read out of bounds) or
    whose ids leave the vocabulary is dropped; the well-formed ones are kept."""
    core = ClientCore(ClientConfig(target="unused", namespace="ns", vocab_size=50), prompt_lookup_fallback)
    s = _remote([1, 2], "a")
    ahead = [
        pb.Prefetch(accepted=[3], tree=_tree([4, 5], [-1, 0])),
        pb.Prefetch(accepted=[6], tree=_tree([4, 5], [-1, 2_000_000_000])),
        pb.Prefetch(accepted=[7], tree=_tree([4, 99], [-1, 0])),
    ]
    resp = pb.DraftResponse(trees=[_tree([3], [-1])], prefetched=[pb.Prefetched(items=ahead)])
    core.trees([s], resp)
    assert list(s.prefetched) == [(3,)]
    # Trees drafted ahead for more items than the call named: none is used.
    two = pb.DraftResponse(trees=[_tree([3], [-1])], prefetched=[pb.Prefetched(items=ahead[:1])] * 2)
    core.trees([s], two)
    assert s.prefetched == {}
