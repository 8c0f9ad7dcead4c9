"""Leases (``gateway/policy.py``): what each request holds loaded, and how, in the ``in-flight`` update mode, a
marked request's lease follows it to the version its engine moved it to, so that older versions drain."""

from __future__ import annotations

import time
from collections.abc import Callable

from streamrl.broker.schema import PolicyRecord
from streamrl.gateway.policy import PolicyRouter, VersionState
from streamrl.gateway.upstreams import UpstreamPool

A, B = "http://a:1", "http://b:1"


def router_with(*versions: int, pinned_hold_s: float = 0.0,
                clock: Callable[[], float] = time.monotonic) -> tuple[PolicyRouter, list[VersionState]]:
    router = PolicyRouter("policy", UpstreamPool((A, B)), pinned_hold_s=pinned_hold_s, clock=clock)
    states = []
    for v in versions:
        state = VersionState(PolicyRecord("policy", v, f"/a/v{v}", "base", v, "0" * 64), loaded_at=1.0)
        router.versions[v] = state
        states.append(state)
    return router, states


def in_flight(states: list[VersionState]) -> list[int]:
    return [s.in_flight for s in states]


def test_a_moved_request_stops_holding_its_older_version_once_its_engine_ran_a_newer_one() -> None:
    router, (v1, v2, v3) = router_with(1, 2, 3)
    idle: list[int] = []
    router.idle_callbacks.append(lambda s: idle.append(s.record.version))
    router.route(v1)
    long_a = router.resolve("policy")
    long_a.mark(A)
    router.route(v2)
    long_b = router.resolve("policy")  # on v2, on the other upstream
    long_b.mark(B)
    pinned = router.resolve("policy@v1")  # pinned: never marked, never moves
    router.route(v3)
    short = router.resolve("policy")
    short.mark(A)
    assert in_flight([v1, v2, v3]) == [2, 1, 1] and long_a.holds == 1

    short.reached_engine()  # A's engine has run a marked request on v3: A's older marked requests moved
    assert long_a.holds == 3 and long_a.version == 1  # the version it was served by, for the record, stays
    assert in_flight([v1, v2, v3]) == [1, 1, 2] and idle == []  # the pinned one still holds v1
    assert long_b.holds == 2  # B's engine has not shown it yet
    assert router.moved_leases == 1 and router.state()["moved_leases"] == 1

    pinned.release()
    assert idle == [1]  # v1 drained: the hot-swap may unload it
    for lease in (long_a, long_b, short):
        lease.release()
    assert in_flight([v1, v2, v3]) == [0, 0, 0] and idle == [1, 2] and not router.marked  # v3 is routed


def test_only_requests_sent_before_the_one_that_came_back_move() -> None:
    """One sent later may still be on its way to the engine, which must find its version loaded."""
    router, (v1, v2) = router_with(1, 2)
    router.route(v2)
    short = router.resolve("policy")
    short.mark(A)
    router.route(v1)  # a lease on an older version sent after it (a request that sat in the gateway)
    late = router.resolve("policy")
    late.mark(A)
    short.reached_engine()
    assert late.holds == 1 and in_flight([v1, v2]) == [1, 1]
    later = router.resolve("policy")  # on v1 too, sent after: a newer evidence on v2 moves both
    later.mark(A)
    router.route(v2)
    again = router.resolve("policy")
    again.mark(A)
    again.reached_engine()
    assert late.holds == later.holds == 2 and in_flight([v1, v2]) == [0, 4]


def test_unmarked_and_re_sent_requests() -> None:
    router, (v1, v2) = router_with(1, 2)
    router.route(v1)
    plain = router.resolve("policy")  # not marked (the mode is off, or the engine cannot move requests)
    retried = router.resolve("policy")
    retried.mark(B)
    retried.mark(A)  # B hung up before answering: sent again, to A
    router.route(v2)
    short = router.resolve("policy")
    short.mark(A)
    short.reached_engine()
    assert plain.holds == 1 and retried.holds == 2 and list(router.marked) == [retried, short]
    unmarked = router.resolve("policy")
    unmarked.reached_engine()  # not marked: says nothing about its engine
    assert plain.holds == 1
    for lease in (plain, retried, short, unmarked):
        lease.release()
        lease.release()  # once only counts
    assert in_flight([v1, v2]) == [0, 0]


def test_a_retired_version_serves_a_pinned_episode_while_held_then_lets_go() -> None:
    """An episode pinned to v1 (a held-out game: several calls) keeps finding v1 after newer versions retired it,
    while its calls follow each other within ``pinned_hold_s``; then v1 closes to new pinned calls."""
    now = [100.0]
    router, (v1, v2) = router_with(1, 2, pinned_hold_s=5.0, clock=lambda: now[0])
    router.route(v2)
    first = router.resolve("policy@v1")
    v1.retiring = True  # the leader retired it while the first call ran
    assert router.held() == {1}
    first.release()
    assert v1.in_flight == 0 and router.held() == {1}, "the next call is on its way"
    now[0] += 4.0
    second = router.resolve("policy@v1")
    assert second is not None and second.version == 1
    second.release()
    now[0] += 5.1
    assert router.held() == set() and router.resolve("policy@v1") is None, "the episode ended: retired for good"
    follower = router.resolve("policy")
    follower.release()
    assert v2.pinned == {}, "a request routed by the policy's name holds nothing after it ends"


def test_an_episode_that_ends_lets_its_pinned_version_go_at_once_and_only_its_own_hold() -> None:
    """Two held-out games pinned to a retired v1: when one ends (its reward, or ``POST /v1/trajectories/end``)
    v1 stays held for the other, whose next move is on its way; when both ended v1 is idle at once, not
    ``pinned_hold_s`` later, so the next version does not wait for room behind an evaluation already over."""
    router, (v1, v2) = router_with(1, 2, pinned_hold_s=5.0)
    router.route(v2)
    idle: list[int] = []
    router.idle_callbacks.append(lambda s: idle.append(s.record.version))
    game_a, game_b = router.resolve("policy@v1", "game-a"), router.resolve("policy@v1", "game-b")
    v1.retiring = True
    game_a.release()
    game_b.release()
    idle.clear()
    assert router.end_episodes(["game-a", "unknown"]) == 1
    assert router.held() == {1} and idle == [], "game b's next move still needs v1"
    next_move = router.resolve("policy@v1", "game-b")
    assert next_move is not None and next_move.version == 1
    next_move.release()
    idle.clear()
    assert router.end_episodes(["game-b"]) == 1
    assert router.held() == set() and idle == [1], "both games over: idle now, not 5 s later"
    assert router.resolve("policy@v1") is None, "retired for good"
    assert router.end_episodes(["game-b"]) == 0, "an episode ends once"


def test_a_pinned_request_still_running_holds_its_version_past_its_episodes_end() -> None:
    router, (_, v2) = router_with(1, 2, pinned_hold_s=5.0)
    router.route(v2)
    running = router.resolve("policy@v1", "game")
    assert router.end_episodes(["game"]) == 0 and router.held() == {1}, "a lease in flight is not a hold"
    running.release()
    assert router.held() == {1}
    assert router.end_episodes(["game"]) == 1 and router.held() == set()


def test_without_a_hold_a_retired_version_closes_to_pinned_calls_at_once() -> None:
    router, (v1, v2) = router_with(1, 2)
    router.route(v2)
    router.resolve("policy@v1").release()
    v1.retiring = True
    assert router.resolve("policy@v1") is None and router.held() == set()
    v1.retiring, v1.unloading = False, True
    assert router.resolve("policy@v1") is None, "an unload under way takes no request"


def test_the_end_of_a_hold_is_an_idle_moment() -> None:
    """The hot-swap unloads retiring versions when they go idle: a hold's end is such a moment (awaited)."""
    import asyncio

    async def main() -> list[int]:
        router, (v1, v2) = router_with(1, 2)
        router.pinned_hold_s = 0.05
        router.route(v2)
        idle: asyncio.Queue[int] = asyncio.Queue()
        router.idle_callbacks.append(lambda s: idle.put_nowait(s.record.version))
        router.resolve("policy@v1").release()
        async with asyncio.timeout(5):
            seen = [await idle.get()]  # at the release: v1 still held then
            seen.append(await idle.get())  # at the hold's end
        assert not v1.held(router.clock())
        return seen

    assert asyncio.run(main()) == [1, 1]
