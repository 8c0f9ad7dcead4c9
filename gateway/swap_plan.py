"""The hot-swap's decisions as pure functions of what a gateway knows: which version to route, which to load
next, which to retire, which retired ones may be unloaded now, which adapters nobody owns. ``hotswap.py``
gathers the facts (the policy topic, the coordination view, the upstreams' lists, the requests in flight),
calls these, and does the I/O they imply; everything that can be decided without I/O is decided here,
where a unit test can state each rule (tests/unit/test_swap_plan.py).

A version's life, as the leader sees it::

    published --(checked, room under max_loaded_versions)--> loading --(on >= 1 upstream)--> loaded
    loaded --(newest loaded on a healthy upstream)--> routed
    loaded --(older than keep_previous_versions before the routed one)--> retiring
    retiring --(every live gateway read that, none uses it, none in flight here)--> unloaded

Followers take ``loaded`` and ``retiring`` from the leader's state and only route.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from streamrl.broker.schema import LoadedVersion

NOT_WRITTEN = None
"""``retiring``'s mark for a version this leader named but has not yet written in a state."""
EARLIER_LEADER = -1
"""``retiring``'s mark for a version an earlier leader named: wait for a state of this leader's naming it."""


@dataclass(frozen=True, slots=True)
class Peer:
    """What the unload rule needs of another live gateway's latest state."""

    seen_offset: int
    in_use: tuple[int, ...]


def version_to_route(loaded: Mapping[int, LoadedVersion], retiring: Collection[int], known: Collection[int],
                     healthy: Collection[str]) -> int | None:
    """The newest loaded version that is not retiring, whose policy record this gateway has read (``known``),
    and that is on an upstream seen healthy (any, while none is: no health yet says nothing). None: keep
    what is routed."""
    healthy = set(healthy)
    for v in sorted(loaded, reverse=True):
        if v in retiring or v not in known:
            continue
        if healthy and not healthy & set(loaded[v].replicas):
            continue
        return v
    return None


def version_to_load(published: Iterable[int], loaded: Collection[int], refused: Collection[int]) -> int | None:
    """The newest published version above every loaded one and not refused: versions in between are skipped,
    the freshest policy is what to serve."""
    top = max(loaded, default=0)
    return max((v for v in published if v > top and v not in refused), default=None)


def versions_to_retire(loaded: Collection[int], retiring: Collection[int], routed: int | None,
                       keep_previous: int) -> list[int]:
    """Loaded versions older than the ``keep_previous`` newest ones before the routed version (none while
    nothing is routed), newest first."""
    if routed is None:
        return []
    previous = sorted((v for v in loaded if v < routed and v not in retiring), reverse=True)
    return previous[keep_previous:]


def versions_to_unload(retiring: Mapping[int, int | None], peers: Iterable[Peer], in_flight_here: Mapping[int, int],
                       routed: int | None, unloading: Collection[int]) -> list[int]:
    """Retiring versions every live gateway has let go of: each peer has written a state read at or past the
    offset of this leader's state naming the version, and does not list it in use; no request runs on it
    here, it is not routed here, and its unload has not begun."""
    peers = list(peers)
    ready = []
    for v, offset in sorted(retiring.items()):
        if offset is NOT_WRITTEN or offset == EARLIER_LEADER or v in unloading or v == routed:
            continue
        if in_flight_here.get(v, 0):
            continue
        if all(p.seen_offset >= offset and v not in p.in_use for p in peers):
            ready.append(v)
    return ready


def orphans(listed: Iterable[str], policy_name: str, loaded: Collection[int]) -> list[str]:
    """Adapters of ``policy_name`` an upstream lists (``<name>@v<N>``) that no leader does, older than the
    newest loaded version: loads of a leader that died, since overtaken. Newer ones may be a load under way."""
    top = max(loaded, default=0)
    prefix = f"{policy_name}@v"
    found = set()
    for name in listed:
        number = name[len(prefix):] if name.startswith(prefix) else ""
        if number.isdigit() and int(number) < top and int(number) not in loaded:
            found.add(name)
    return sorted(found)
