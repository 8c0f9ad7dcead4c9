"""The hot-swap's rules (gateway/swap_plan.py), each stated on the facts a gateway gathers."""

from __future__ import annotations

from streamrl.broker.schema import LoadedVersion
from streamrl.gateway.swap_plan import (
    EARLIER_LEADER,
    NOT_WRITTEN,
    Peer,
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


def test_unload_a_retiring_version_once_every_live_gateway_let_it_go() -> None:
    retiring = {1: 10, 2: 10}
    caught_up = Peer(seen_offset=10, in_use=(3,))
    assert versions_to_unload(retiring, [caught_up], {}, routed=3, unloading=()) == [1, 2]
    assert versions_to_unload(retiring, [Peer(9, (3,))], {}, routed=3, unloading=()) == [], "a peer has not read it"
    assert versions_to_unload(retiring, [caught_up, Peer(11, (2, 3))], {}, routed=3, unloading=()) == [1], \
        "a peer still runs requests on v2"
    assert versions_to_unload(retiring, [caught_up], {1: 1}, routed=3, unloading=()) == [2], "in flight here"
    assert versions_to_unload(retiring, [caught_up], {}, routed=3, unloading={2}) == [1], "already unloading"
    assert versions_to_unload({1: NOT_WRITTEN, 2: EARLIER_LEADER}, [caught_up], {}, routed=3, unloading=()) == [], \
        "named in no state of this leader yet"
    assert versions_to_unload({3: 10}, [], {}, routed=3, unloading=()) == [], "never the routed version"
    assert versions_to_unload(retiring, [], {}, routed=3, unloading=()) == [1, 2], "alone: nobody to wait for"


def test_orphans_are_older_unlisted_adapters_of_this_policy_only() -> None:
    listed = ["policy@v1", "policy@v2", "policy@v5", "policy@v9", "other@v1", "base-model", "policy@vX"]
    assert orphans(listed, "policy", loaded={2, 5}) == ["policy@v1"]
    assert orphans(listed, "policy", loaded=()) == [], "nothing loaded: nothing is known to be overtaken"
