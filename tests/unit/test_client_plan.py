"""One decode step's draft plan, driven by hand: the effects it asks a client for, in order, and
the trees it returns for what each effect got. No server, no transport."""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence

import numpy as np
from draftcache.v1 import draftcache_pb2 as pb

from decoder_client.client import ClientConfig, ClientSession, prompt_lookup_fallback
from decoder_client.client.core import ClientCore
from decoder_client.client.plan import CatchUp, Draft, DraftAhead, Drafted, Effect, Reopen, draft_step
from indexer.drafter import DraftParams
from indexer.tree_builder import DraftTree

Step = Generator[Effect, list[Drafted] | None, list[DraftTree]]


def _core(
    *, deadline_s: float = 0.005, lookahead: int = 0, continue_chains: bool = False, chain_take: int = 0
) -> ClientCore:
    params = DraftParams(chain=8) if continue_chains else DraftParams()
    config = ClientConfig(
        target="unused",
        namespace="ns",
        params=params,
        deadline_s=deadline_s,
        lookahead=lookahead,
        continue_chains=continue_chains,
        chain_take=chain_take,
    )
    return ClientCore(config, prompt_lookup_fallback)


def _remote(context: list[int], server_id: str) -> ClientSession:
    s = ClientSession(context, len(context))
    s.server_id = server_id
    return s


def _tree(*tokens: int) -> DraftTree:
    return DraftTree.chain(np.array(tokens, dtype=np.int32))


def _answer(*trees: list[int], scores: list[float] | None = None) -> pb.DraftResponse:
    return pb.DraftResponse(
        trees=[pb.Tree(tokens=t, parents=list(range(-1, len(t) - 1)), scores=scores or [1.0] * len(t)) for t in trees]
    )


def _run(step: Step, replies: Sequence[Drafted | list[Drafted] | None]) -> tuple[list[Effect], list[DraftTree]]:
    """Every effect the step yields, answering the i-th with ``replies[i]`` (None past the end;
    a :class:`Drafted` alone: the one call's)."""
    effects: list[Effect] = []
    try:
        effect = next(step)
        while True:
            effects.append(effect)
            reply = replies[len(effects) - 1] if len(effects) <= len(replies) else None
            effect = step.send([reply] if isinstance(reply, Drafted) else reply)
    except StopIteration as done:
        return effects, done.value


def test_a_step_catches_up_reopens_then_sends_the_new_tokens_within_the_deadline() -> None:
    core = _core(deadline_s=0.5)
    s = _remote([1, 2, 3], "a")
    before = time.monotonic()
    effects, trees = _run(draft_step(core, [s], [[4, 5]]), [None, None, Drafted(_answer([6, 7]))])
    catch_up, reopen, draft = effects
    assert isinstance(catch_up, CatchUp) and before + 0.5 <= catch_up.end <= time.monotonic() + 0.5
    assert isinstance(reopen, Reopen) and list(reopen.sessions) == [s]
    # The tokens are in the context before the call: a re-open would send them too.
    assert isinstance(draft, Draft) and 0 < draft.left <= 0.5
    assert list(draft.requests[0].columns.session_ids) == ["a"] and list(draft.requests[0].columns.new_tokens) == [4, 5]
    assert [t.tokens.tolist() for t in trees] == [[6, 7]]
    assert s.context.tolist() == [1, 2, 3, 4, 5] and s.pending == []  # the service has them
    assert core.stats.remote == 1 and core.stats.fallback == 0


def test_sessions_without_a_server_copy_draft_locally_and_need_no_call() -> None:
    core = _core()
    s = ClientSession([1, 2, 3, 1, 2], 5)
    effects, trees = _run(draft_step(core, [s], [[]]), [])
    assert [type(e) for e in effects] == [CatchUp, Reopen]  # no draft call
    assert trees[0].tokens.tolist() == [3, 1, 2]  # prompt lookup: "1 2" was followed by "3 1 2"
    assert core.stats.fallback == 1


def test_a_failed_call_falls_back_and_puts_the_server_copy_in_doubt() -> None:
    core = _core()
    s = _remote([1, 2, 1], "a")
    effects, trees = _run(draft_step(core, [s], [[2]]), [None, None, Drafted(None)])
    assert isinstance(effects[-1], Draft)
    assert trees[0].tokens.tolist() == [1, 2]  # the fallback's
    # The copy may have missed the token: it is closed and the session re-opened later.
    assert s.server_id == "" and core.abandoned == ["a"]


def test_a_call_late_on_a_stream_keeps_the_copy_and_is_watched() -> None:
    core = _core()
    s = _remote([1, 2, 1], "a")
    late = object()  # the call still under way; the plan only keeps it
    _, trees = _run(draft_step(core, [s], [[2]]), [None, None, Drafted(None, late)])
    assert trees[0].tokens.tolist() == [1, 2]  # the fallback answers this step
    # The service applies the late call before anything sent after it: its tokens count as sent.
    assert s.server_id == "a" and s.pending == [] and core.abandoned == []
    assert core.late == [([(s, "a")], late)]


def test_a_catch_up_that_spends_the_deadline_leaves_no_time_for_a_call() -> None:
    core = _core(deadline_s=0.001)
    s = _remote([1, 2, 1], "a")
    step = draft_step(core, [s], [[2]])
    assert isinstance(next(step), CatchUp)
    time.sleep(0.002)  # as a slow earlier call would
    effects, trees = _run(step, [])
    assert [type(e) for e in effects] == [Reopen]
    assert trees[0].tokens.tolist() == [1, 2] and s.pending == [2]  # sent with the next call


def test_trees_drafted_ahead_answer_at_once_and_their_tokens_go_in_the_background() -> None:
    core = _core(lookahead=1)
    hit, miss = _remote([1, 2], "h"), _remote([3, 4], "m")
    hit.prefetched = {(): _tree(7, 8, 9)}  # drafted for "7 accepted as the bonus token"
    miss.prefetched = {(): _tree(5)}
    effects, trees = _run(draft_step(core, [hit, miss], [[7], [6]]), [None, None, Drafted(_answer([60]))])
    _, _, draft, ahead = effects
    assert isinstance(draft, Draft) and list(draft.requests[0].columns.session_ids) == ["m"]
    assert list(draft.requests[0].columns.lookahead) == []  # the step's draft waits on nothing drafted ahead
    # One background call: the hit's tokens, and the outcomes ahead of both trees just handed
    # out (the miss's copy has all its tokens: the service drafts only what lies ahead).
    assert isinstance(ahead, DraftAhead) and [part for part, _ in ahead.parts] == [[hit, miss]]
    cols = ahead.parts[0][1].columns
    assert list(cols.new_token_counts) == [1, 0] and list(cols.new_tokens) == [7] and list(cols.lookahead) == [1, 1]
    # In the sessions' order: the tree below 7 drafted ahead, then the fresh one.
    assert [t.tokens.tolist() for t in trees] == [[8, 9], [60]]
    assert (core.stats.ahead_hits, core.stats.ahead_misses) == (1, 1)
    assert hit.pending == [7]  # until the background call is settled


def test_a_chain_that_foresaw_the_outcome_goes_on_at_once_and_its_tokens_go_in_the_background() -> None:
    core = _core(continue_chains=True)
    s = _remote([1, 2], "a")
    chain = [7, 8, 9, 10, 11]
    effects, trees = _run(
        draft_step(core, [s], [[3]]), [None, None, Drafted(_answer(chain, scores=[0.9, 0.8, 0.6, 0.3, 0.1]))]
    )
    assert [type(e) for e in effects] == [CatchUp, Reopen, Draft] and trees[0].tokens.tolist() == chain
    assert (s.chain_at, s.chain.tokens.tolist()) == (3, chain)  # drafted for the context [1, 2, 3]
    # The engine proposed 7 and 8 (it cut the chain there), took both and made 9: the chain
    # foresaw it. The rest comes at once, each token's chance now given 7, 8, 9.
    effects, trees = _run(draft_step(core, [s], [[7, 8, 9]]), [])
    assert [type(e) for e in effects] == [CatchUp, Reopen, DraftAhead]
    assert list(effects[2].parts[0][1].columns.new_tokens) == [7, 8, 9]
    assert trees[0].tokens.tolist() == [10, 11] and np.allclose(trees[0].scores, [0.5, 1 / 6])
    assert core.stats.continued == 1 and s.pending == [7, 8, 9]
    # The call in the background brings the chain for after 9; the next outcome leaves it (12
    # was made where it drafted 20): a call, within the step.
    core.answered([s], _answer([20, 21], scores=[0.5, 0.4]))
    assert (s.chain_at, s.chain.tokens.tolist(), s.pending) == (6, [20, 21], [])
    effects, trees = _run(draft_step(core, [s], [[12]]), [None, None, Drafted(_answer([30]))])
    assert [type(e) for e in effects] == [CatchUp, Reopen, Draft] and trees[0].tokens.tolist() == [30]
    assert core.stats.continued == 1 and (s.chain_at, s.chain.tokens.tolist()) == (7, [30])


def test_a_continued_chains_rest_goes_on_only_where_the_decoder_would_take_no_more_of_a_call() -> None:
    # Chains of 8 asked, the decoder takes 4 (and is cut at 0.1): a chain of 8 sure tokens,
    # taken 4 and the bonus token, leaves 3, where a call brings 8 again: the step calls.
    core = _core(continue_chains=True, chain_take=4)
    core.cut_chains_at(0.1)
    s = _remote([1, 2], "a")
    sure = list(range(10, 18))
    _run(draft_step(core, [s], [[3]]), [None, None, Drafted(_answer(sure))])
    effects, trees = _run(draft_step(core, [s], [sure[:5]]), [None, None, Drafted(_answer(list(range(20, 28))))])
    assert [type(e) for e in effects] == [CatchUp, Reopen, Draft] and trees[0].tokens.tolist() == list(range(20, 28))
    assert core.stats.continued == 0
    # Taken 3 and the bonus token: the 4 left fill what the decoder takes, at once.
    effects, trees = _run(draft_step(core, [s], [[20, 21, 22, 23]]), [])
    assert [type(e) for e in effects] == [CatchUp, Reopen, DraftAhead] and trees[0].tokens.tolist() == [24, 25, 26, 27]
    assert core.stats.continued == 1
    # A rest shorter than that, which falls below the decoder's cut: all the decoder would take.
    core.answered([s], _answer(list(range(30, 38)), scores=[0.9, 0.8, 0.7, 0.6, 0.5, 0.3, 0.1, 0.04]))
    effects, trees = _run(draft_step(core, [s], [[30, 31, 32, 33, 34]]), [])
    assert [type(e) for e in effects] == [CatchUp, Reopen, DraftAhead] and trees[0].tokens.tolist() == [35, 36, 37]
    assert core.stats.continued == 2
    # A chain that ended short of the length asked, at its own chances, goes by the same rule:
    # its sure rest of 2, drafted from further back, is not what a call brings now.
    core.answered([s], _answer([40, 41, 42, 43, 44, 45], scores=[0.9, 0.8, 0.7, 0.6, 0.5, 0.45]))
    effects, trees = _run(draft_step(core, [s], [[40, 41, 42, 43]]), [None, None, Drafted(_answer([50]))])
    assert [type(e) for e in effects] == [CatchUp, Reopen, Draft] and trees[0].tokens.tolist() == [50]
    assert core.stats.continued == 2


def test_tokens_added_while_a_call_is_in_the_background_stay_pending() -> None:
    core = _core(continue_chains=True)
    s = _remote([1, 2], "a")
    _run(draft_step(core, [s], [[3]]), [None, None, Drafted(_answer([7, 8, 9, 10], scores=[0.9, 0.8, 0.6, 0.3]))])
    effects, _ = _run(draft_step(core, [s], [[7, 8, 9]]), [])  # continued: 7, 8, 9 go in the background
    assert isinstance(effects[-1], DraftAhead)
    core.add_tokens([s], [[10]])  # the generation's last step, recorded before its close
    core.answered([s], _answer([20], scores=[0.5]))  # the close settles the background call
    assert s.pending == [10] and s.chain_at == 6
    close = core.close_request([s], commit=True)
    assert close is not None and list(close.sessions[0].new_tokens) == [10]  # the commit has every token


def test_continued_chains_are_asked_to_run_on_past_the_cut() -> None:
    def asked(core: ClientCore) -> float:
        request = core.open_request([ClientSession([1, 2], 2)], now=True)
        assert request is not None
        return request.sessions[0].params.chain_min_prob

    params = DraftParams(chain=8, chain_min_prob=0.2)
    on = ClientCore(
        ClientConfig(target="x", namespace="ns", params=params, continue_chains=True, chain_run_on=0.5),
        prompt_lookup_fallback,
    )
    off = ClientCore(ClientConfig(target="x", namespace="ns", params=params), prompt_lookup_fallback)
    assert np.isclose(asked(on), 0.1) and np.isclose(asked(off), 0.2)
    on.cut_chains_at(0.4)
    off.cut_chains_at(0.4)
    assert np.isclose(asked(on), 0.2) and np.isclose(asked(off), 0.4)


def test_chains_go_on_only_when_asked() -> None:
    core = _core()
    s = _remote([1, 2], "a")
    _run(draft_step(core, [s], [[3]]), [None, None, Drafted(_answer([7, 8, 9]))])
    effects, _ = _run(draft_step(core, [s], [[7]]), [None, None, Drafted(_answer([5]))])
    assert isinstance(effects[2], Draft) and s.chain is None and core.stats.continued == 0


def test_a_step_while_the_service_is_skipped_keeps_the_copy_and_the_tokens_pending() -> None:
    core = _core()
    s = _remote([1, 2, 1], "a")
    core.failed(None)  # earlier calls missed their deadlines in a row: the service is skipped a while
    core.failed(None)
    effects, trees = _run(draft_step(core, [s], [[2]]), [])
    assert not any(isinstance(e, Draft) for e in effects)  # nothing sent
    assert trees[0].tokens.tolist() == [1, 2]  # the fallback's
    # The copy missed nothing: no re-open, the token goes with the next call.
    assert s.server_id == "a" and s.pending == [2] and core.abandoned == []
    core.down_until = 0.0
    assert list(core.draft_request([s]).columns.new_tokens) == [2]


def test_drafting_ahead_follows_an_answered_draft_and_never_a_failed_one() -> None:
    core = _core(lookahead=2)
    s = _remote([1, 2], "a")
    effects, trees = _run(draft_step(core, [s], [[3]]), [None, None, Drafted(_answer([4, 5]))])
    _, _, draft, ahead = effects
    assert isinstance(draft, Draft) and list(draft.requests[0].columns.lookahead) == []
    assert trees[0].tokens.tolist() == [4, 5] and s.pending == []
    assert isinstance(ahead, DraftAhead) and [part for part, _ in ahead.parts] == [[s]]
    assert list(ahead.parts[0][1].columns.new_token_counts) == [0] and list(ahead.parts[0][1].columns.lookahead) == [2]
    # The call failed: the fallback answers, the tokens wait for the next call, nothing goes ahead.
    t = _remote([1, 2], "b")
    effects, trees = _run(draft_step(core, [t], [[3]]), [None, None, Drafted(None)])
    assert not any(isinstance(e, DraftAhead) for e in effects)
    assert core.stats.fallback == 1


def _split_core(max_batch: int) -> ClientCore:
    config = ClientConfig(target="unused", namespace="ns", deadline_s=0.5, max_batch=max_batch)
    return ClientCore(config, prompt_lookup_fallback)


def test_a_batch_within_max_batch_is_one_call() -> None:
    core = _split_core(3)
    sessions = [_remote([1, 2], f"s{i}") for i in range(3)]
    effects, _ = _run(draft_step(core, sessions, [[3]] * 3), [None, None, Drafted(_answer([4], [4], [4]))])
    (draft,) = [e for e in effects if isinstance(e, Draft)]
    assert len(draft.requests) == 1 and list(draft.requests[0].columns.session_ids) == ["s0", "s1", "s2"]
    assert core.stats.remote == 3


def test_a_batch_over_max_batch_goes_in_parts_and_a_failed_part_falls_back_alone() -> None:
    core = _split_core(2)
    local = ClientSession([1, 2, 1], 3)  # no server copy: it goes along, and drafts locally
    sessions = [_remote([1, 2, 1], "a"), local, *(_remote([1, 2, 1], sid) for sid in "bcde")]
    replies: list[Drafted | list[Drafted] | None] = [
        None,
        None,
        [Drafted(_answer([7], [8])), Drafted(None), Drafted(_answer([9]))],  # the second part failed
    ]
    effects, trees = _run(draft_step(core, sessions, [[2]] * 6), replies)
    (draft,) = [e for e in effects if isinstance(e, Draft)]
    assert [list(r.columns.session_ids) for r in draft.requests] == [["a", "b"], ["c", "d"], ["e"]]
    assert all(list(r.columns.new_tokens) == [2] * len(r.columns.session_ids) for r in draft.requests)
    # In the sessions' order: the first part's trees, the local one, the failed part's local ones, the last part's.
    assert [t.tokens.tolist() for t in trees] == [[7], [1, 2], [8], [1, 2], [1, 2], [9]]
    assert (core.stats.remote, core.stats.fallback) == (3, 3)
    assert [s.server_id for s in sessions] == ["a", "", "b", "", "", "e"]  # the failed part's copies in doubt
    assert core.abandoned == ["c", "d"]


def test_a_part_refused_for_its_size_leaves_its_copies_and_tokens_for_the_next_call() -> None:
    core = _split_core(2)
    sessions = [_remote([1, 2, 1], sid) for sid in "abc"]
    replies: list[Drafted | list[Drafted] | None] = [
        None,
        None,
        [Drafted(_answer([7], [8])), Drafted(None, oversized=True)],
    ]
    _, trees = _run(draft_step(core, sessions, [[2]] * 3), replies)
    assert [t.tokens.tolist() for t in trees] == [[7], [8], [1, 2]]
    # It changed nothing on the service: the copy is kept, its token still to send.
    assert sessions[2].server_id == "c" and sessions[2].pending == [2] and core.abandoned == []
    assert sessions[0].pending == []
