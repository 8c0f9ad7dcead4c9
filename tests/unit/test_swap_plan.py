"""The hot-swap's plan (gateway/swap_plan.py): each rule stated on the facts a gateway gathers, and the lives of
``SwapPlan`` (a leader's, a follower's, a take-over) as events in and decisions out, with no Kafka and no vLLM."""

from __future__ import annotations

from streamrl.broker.schema import GatewayState, LoadedVersion, PolicyRecord
from streamrl.gateway.swap_plan import (
    EARLIER_LEADER,
    NOT_WRITTEN,
    Peer,
    SwapPlan,
    orphans,
    version_to_load,
    version_to_route,
    versions_to_retire,
    versions_to_unload,
)

A, B = "http://a", "http://b"


def loaded(**where: tuple[str, ...]) -> dict[int, LoadedVersion]:
    return {int(v[1:]): LoadedVersion(int(v[1:]), replicas) for v, replicas in where.items()}


def test_route_the_newest_loaded_version_a_healthy_upstream_has() -> None:
    lv = loaded(v1=(A, B), v2=(A,), v3=(B,))
    assert version_to_route(lv, retiring=(), known={1, 2, 3}, healthy={A, B}) == 3
    assert version_to_route(lv, retiring=(), known={1, 2, 3}, healthy={A}) == 2, "v3's only replica is down"
    assert version_to_route(lv, retiring={3}, known={1, 2, 3}, healthy={A, B}) == 2, "retiring takes no new requests"
    assert version_to_route(lv, retiring=(), known={1, 2}, healthy={A, B}) == 2, "v3's record not read yet"
    assert version_to_route(lv, retiring=(), known={1, 2, 3}, healthy=()) == 3, "no health known: any replica"
    assert version_to_route({}, retiring=(), known=(), healthy={A}) is None


def test_load_the_newest_published_version_skipping_those_in_between() -> None:
    assert version_to_load([1, 2, 3, 4], loaded={1}, refused=()) == 4
    assert version_to_load([1, 2, 3, 4], loaded={1}, refused={4}) == 3, "a refused record is never retried"
    assert version_to_load([1, 2], loaded={2}, refused=()) is None, "nothing above the newest loaded"
    assert version_to_load([], loaded=(), refused=()) is None


def test_retire_what_is_older_than_the_kept_previous_versions() -> None:
    assert versions_to_retire({1, 2, 3, 4, 5}, retiring=(), routed=5, keep_previous=1) == [3, 2, 1]
    assert versions_to_retire({1, 2, 3, 4, 5}, retiring={1}, routed=5, keep_previous=1) == [3, 2]
    assert versions_to_retire({1, 2, 3}, retiring=(), routed=2, keep_previous=0) == [1], "v3, newer, loads on"
    assert versions_to_retire({1, 2, 3}, retiring=(), routed=None, keep_previous=0) == []
    # a retiring version still held (an evaluation pinned to it) takes the kept place: v4 retires, so the next
    # version finds room under max_loaded_versions = 3 (v2 held, v5 routed, v6 loading)
    assert versions_to_retire({2, 4, 5}, retiring={2}, routed=5, keep_previous=1, held={2}) == [4]
    assert versions_to_retire({2, 4, 5}, retiring={2}, routed=5, keep_previous=1, held=()) == [], "v2 let go"
    assert versions_to_retire({2, 3, 4, 5}, retiring={2}, routed=5, keep_previous=2, held={2}) == [3]


def test_unload_a_retiring_version_once_every_live_gateway_let_it_go() -> None:
    retiring = {1: 10, 2: 10}
    caught_up = Peer(seen_offset=10, in_use=(3,))
    assert versions_to_unload(retiring, [caught_up], {}, routed=3, unloading=()) == [1, 2]
    assert versions_to_unload(retiring, [Peer(9, (3,))], {}, routed=3, unloading=()) == [], "a peer has not read it"
    assert versions_to_unload(retiring, [caught_up, Peer(11, (2, 3))], {}, routed=3, unloading=()) == [1], \
        "a peer still runs requests on v2"
    assert versions_to_unload(retiring, [caught_up], {1}, routed=3, unloading=()) == [2], "held here"
    assert versions_to_unload(retiring, [caught_up], {}, routed=3, unloading={2}) == [1], "already unloading"
    assert versions_to_unload({1: NOT_WRITTEN, 2: EARLIER_LEADER}, [caught_up], {}, routed=3, unloading=()) == [], \
        "named in no state of this leader yet"
    assert versions_to_unload({3: 10}, [], {}, routed=3, unloading=()) == [], "never the routed version"
    assert versions_to_unload(retiring, [], {}, routed=3, unloading=()) == [1, 2], "alone: nobody to wait for"


def test_orphans_are_older_unlisted_adapters_of_this_policy_only() -> None:
    listed = ["policy@v1", "policy@v2", "policy@v5", "policy@v9", "other@v1", "base-model", "policy@vX"]
    assert orphans(listed, "policy", loaded={2, 5}) == ["policy@v1"]
    assert orphans(listed, "policy", loaded=()) == [], "nothing loaded: nothing is known to be overtaken"


def record(version: int) -> PolicyRecord:
    return PolicyRecord(name="policy", version=version, step=version, path=f"/adapters/policy/v{version}",
                        base_model="m", sha256="0" * 64)


def leader_plan(max_loaded: int = 3, keep_previous: int = 1) -> SwapPlan:
    """A plan that leads, has taken over (nothing left by an earlier leader) and has read the policy topic."""
    plan = SwapPlan("policy", max_loaded, keep_previous)
    assert plan.lead(True), "the first word that this gateway leads is a change"
    assert plan.to_load() is None, "no load before the take-over"
    plan.take_over(None)
    assert plan.confirm({A: set(), B: set()}, any_healthy=True) == {A: set(), B: set()}
    plan.caught_up = True
    return plan


def test_a_leaders_life_load_the_newest_route_it_retire_and_unload_the_old() -> None:
    plan = leader_plan(max_loaded=4, keep_previous=1)
    for v in (1, 2, 3):
        plan.published(record(v))
    assert plan.to_load() == 3, "v1 and v2 are skipped: the freshest policy is served"
    plan.loaded_on(3, {A: {"policy@v3"}, B: {"policy@v3"}})
    assert plan.loaded[3] == LoadedVersion(3, (A, B))
    assert plan.to_route(known={3}, healthy={A, B}) == 3 and plan.to_load() is None
    for v in (4, 5, 6):
        plan.published(record(v))
        assert plan.room()
        plan.loaded_on(plan.to_load(), {A: {f"policy@v{v}"}})
        assert plan.to_retire(routed=v) == ([v - 2] if v >= 5 else []), "one previous version kept"
    assert plan.retiring == {3: NOT_WRITTEN, 4: NOT_WRITTEN}
    assert plan.written_view() == ((LoadedVersion(3, (A, B)), LoadedVersion(4, (A,)), LoadedVersion(5, (A,)),
                                    LoadedVersion(6, (A,))), (3, 4))
    assert not plan.room(), "4 loaded, 4 allowed: the next load waits for an unload"
    assert plan.to_unload([], {}, routed=6) == [], "not unloaded before a state naming them is written"
    plan.written(offset=40, retiring=(3, 4))
    peer = Peer(seen_offset=39, in_use=(6,))
    assert plan.to_unload([peer], {}, routed=6) == [], "a live gateway has not read that state"
    assert plan.to_unload([Peer(40, (4, 6))], set(), routed=6) == [3], "v4 still used by a peer"
    assert plan.to_unload([Peer(40, (6,))], {}, routed=6) == [4], "v3's unload is under way: not twice"
    plan.unloaded(3)
    plan.unloading.discard(3)
    assert 3 not in plan.loaded and 3 not in plan.retiring
    plan.written(offset=41, retiring=(4,))
    assert plan.retiring[4] == 40, "a version keeps the offset of the first state that named it"


def test_a_refused_version_is_never_loaded_and_an_older_one_is_not_taken_instead() -> None:
    plan = leader_plan()
    plan.published(record(1))
    plan.refuse(1)
    assert plan.to_load() is None
    plan.published(record(2))
    assert plan.to_load() == 2


def test_a_follower_takes_the_leaders_word_and_writes_none_of_its_own() -> None:
    plan = SwapPlan("policy", 3, 1)
    assert not plan.lead(False) and plan.to_load() is None
    word = GatewayState("g0", "policy", loaded=(LoadedVersion(4, (A,)), LoadedVersion(5, (A, B))), retiring=(4,),
                        leader=True)
    plan.follow(word)
    assert plan.adapters_of(A) == {"policy@v4", "policy@v5"} and plan.adapters_of(B) == {"policy@v5"}
    assert plan.retiring == {4: EARLIER_LEADER}
    assert plan.to_route(known={4, 5}, healthy={A}) == 5
    assert plan.to_route(known={4}, healthy={A}) is None, "v5's record not read: nothing to route yet"
    assert plan.written_view() == ((), ())
    plan.follow(GatewayState("g1", "policy", loaded=(), leader=False))
    assert 5 in plan.loaded, "a state not written as leader (one just elected) changes nothing"
    plan.follow(None)
    assert 5 in plan.loaded


def test_a_take_over_checks_the_last_leaders_word_against_the_upstreams() -> None:
    plan = SwapPlan("policy", 3, 1)
    for v in (6, 7, 8, 9):
        plan.published(record(v))
    assert plan.lead(True) and not plan.lead(True), "a change once"
    last = GatewayState("g0", "policy", loaded=(LoadedVersion(6, (A, B)), LoadedVersion(7, (A, B))), retiring=(6,),
                        leader=True)
    plan.take_over(last)
    assert plan.to_load() is None and plan.to_retire(routed=7) == [], "nothing decided before the check"
    listed = {A: {"m", "policy@v5", "policy@v7", "policy@v8"}, B: {"m", "policy@v6"}}
    assert plan.confirm(listed, any_healthy=True) == {A: {"policy@v7"}, B: {"policy@v6"}}
    assert plan.loaded == {6: LoadedVersion(6, (B,)), 7: LoadedVersion(7, (A,))}
    assert plan.retiring == {6: NOT_WRITTEN}, "the dead leader's retiring named again before any unload"
    assert plan.to_load() == 9, "v8, half loaded by the dead leader, is overtaken"
    assert plan.to_sweep(listed[A] | listed[B]) == [], "not before the policy topic is read"
    plan.caught_up = True
    assert plan.to_sweep(listed[A] | listed[B]) == ["policy@v5"], "older than v7 and listed by no leader"
    assert plan.to_sweep(listed[A] | listed[B]) == [], "swept once"
    plan.lead(False)
    assert not plan.led and plan.to_load() is None, "stepping down stops the loads"
    assert plan.to_retire(routed=9) == [], "and the retiring: a follower only routes"


def test_leadership_lost_during_the_take_over_is_not_taken_up_again() -> None:
    plan = SwapPlan("policy", 3, 1)
    plan.lead(True)
    plan.take_over(None)
    plan.lead(False)  # while the upstreams were asked what they hold
    plan.confirm({A: set()}, any_healthy=True)
    plan.published(record(1))
    assert not plan.led and plan.to_load() is None


def test_a_take_over_drops_what_no_upstream_holds_unless_none_is_healthy() -> None:
    last = GatewayState("g0", "policy", loaded=(LoadedVersion(3, (A,)),), retiring=(3,), leader=True)
    for healthy, kept in ((True, {}), (False, {3: LoadedVersion(3, ())})):
        plan = SwapPlan("policy", 3, 1)
        plan.lead(True)
        plan.take_over(last)
        plan.confirm({A: {"m"}}, any_healthy=healthy)
        assert plan.loaded == kept, "restarted since: nothing of it left" if healthy else "no health: nothing known"


def test_replicas_follow_the_upstreams_adapters() -> None:
    plan = leader_plan()
    plan.loaded_on(1, {A: {"policy@v1"}, B: set()})
    assert not plan.replicas_changed({A: {"policy@v1"}, B: set()})
    assert plan.replicas_changed({A: {"policy@v1"}, B: {"policy@v1"}}) and plan.loaded[1].replicas == (A, B)
