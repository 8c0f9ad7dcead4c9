"""The hot-swap as a plan: what one gateway knows of its policy's versions (``SwapPlan``: published records,
the leader's ``loaded`` and ``retiring``, refused versions, unloads under way, whether it leads), the events
that change it, and the decisions that follow (which version to route, which to load next, which to retire,
which retired ones may be unloaded now, which adapters nobody owns), all without I/O. ``hotswap.py`` gathers
the events (the policy topic, the coordination view, the upstreams' lists, the requests in flight), hands them
to the plan, and carries out what it decides (load, route, write the state, unload). Each rule and each life
is stated in tests/unit/test_swap_plan.py, with no Kafka and no vLLM.

A version's life, as the leader sees it::

    published --(checked, room under max_loaded_versions)--> loading --(on >= 1 upstream)--> loaded
    loaded --(newest loaded on a healthy upstream)--> routed
    loaded --(older than keep_previous_versions before the routed one)--> retiring
    retiring --(every live gateway read that, none uses it, none in flight here)--> unloaded

Followers take ``loaded`` and ``retiring`` from the leader's state and only route.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

from streamrl.broker.schema import GatewayState, LoadedVersion, PolicyRecord, served_name

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
                       keep_previous: int, held: Collection[int] = ()) -> list[int]:
    """Loaded versions older than the ``keep_previous`` newest ones before the routed version (none while
    nothing is routed), newest first. Retiring versions still held (requests on them, a pinned episode's next
    call on its way) fill those places first: they stay loaded anyway, and a kept version beside them would
    leave the next version no room under ``max_loaded_versions``."""
    if routed is None:
        return []
    keep = max(0, keep_previous - sum(1 for v in retiring if v in held and v in loaded))
    previous = sorted((v for v in loaded if v < routed and v not in retiring), reverse=True)
    return previous[keep:]


def versions_to_unload(retiring: Mapping[int, int | None], peers: Iterable[Peer], held_here: Collection[int],
                       routed: int | None, unloading: Collection[int]) -> list[int]:
    """Retiring versions every live gateway has let go of: each peer has written a state read at or past the
    offset of this leader's state naming the version, and does not list it in use; it is not held here
    (``policy.VersionState.held``), not routed here, and its unload has not begun."""
    peers = list(peers)
    ready = []
    for v, offset in sorted(retiring.items()):
        if offset is NOT_WRITTEN or offset == EARLIER_LEADER or v in unloading or v == routed:
            continue
        if v in held_here:
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


@dataclass
class SwapPlan:
    """One gateway's knowledge of one policy's versions; events in (``published``, ``follow``, ``take_over``,
    ``loaded_on``, ``written``, ``unloaded``), decisions out (``to_load``, ``to_route``, ``to_retire``,
    ``to_unload``, ``to_sweep``). A follower's ``loaded`` and ``retiring`` are the leader's word; the leader's
    are its own."""

    policy_name: str
    max_loaded: int
    keep_previous: int
    records: dict[int, PolicyRecord] = field(default_factory=dict)
    """Published versions from trusted publishers, by version (followers route among the leader's)."""
    loaded: dict[int, LoadedVersion] = field(default_factory=dict)
    """The leader's word on which versions are loaded where: this gateway's own while it leads."""
    retiring: dict[int, int | None] = field(default_factory=dict)
    """Versions to unload -> offset of the first state of the leader that named them (``NOT_WRITTEN``,
    ``EARLIER_LEADER``)."""
    refused: set[int] = field(default_factory=set)
    unloading: set[int] = field(default_factory=set)
    leading: bool = False
    """The coordination view names this gateway; ``led`` once it has taken over what the last leader left."""
    led: bool = False
    caught_up: bool = False
    """The policy topic has been read to its end once (orphans are swept only then)."""
    sweep_pending: bool = False

    def served(self, version: int) -> str:
        return served_name(self.policy_name, version)

    # -- events --------------------------------------------------------------------------------------
    def published(self, record: PolicyRecord) -> None:
        self.records[record.version] = record

    def refuse(self, version: int) -> None:
        """A record whose adapter failed its check: never loaded, never retried."""
        self.refused.add(version)

    def lead(self, leading: bool) -> bool:
        """The coordination view's word on leadership; True when this gateway has just become the leader (it
        takes over before it loads anything: ``led`` stays False until ``take_over``)."""
        became = leading and not self.leading
        self.leading = leading
        if not leading:
            self.led = False
        return became

    def follow(self, leader: GatewayState | None) -> None:
        """A follower takes ``loaded`` and ``retiring`` from the leader's latest state (one written as leader)."""
        if leader is not None and leader.leader:
            self.loaded = {lv.version: lv for lv in leader.loaded}
            self.retiring = dict.fromkeys(leader.retiring, EARLIER_LEADER)

    def take_over(self, last: GatewayState | None) -> None:
        """Becoming the leader: start from what the last leader wrote (its retiring versions to be named again in
        a state of this leader's before they are unloaded); ``confirm`` checks it against the upstreams."""
        if last is not None:
            self.loaded = {lv.version: lv for lv in last.loaded}
            self.retiring = dict.fromkeys(last.retiring, NOT_WRITTEN)

    def confirm(self, listed: Mapping[str, Collection[str]], any_healthy: bool) -> dict[str, set[str]]:
        """After ``take_over``, with what each upstream lists now (url -> served names): each loaded version on the
        upstreams that list it, a version none lists dropped (every upstream restarted since), orphans to be
        swept once the policy topic is read; the leader leads from here. Returns each upstream's adapters."""
        adapters = {url: {self.served(v) for v in self.loaded if self.served(v) in names}
                    for url, names in listed.items()}
        for v in list(self.loaded):
            self.loaded[v] = self.where(v, adapters)
            if not self.loaded[v].replicas and any_healthy:
                del self.loaded[v]
                self.retiring.pop(v, None)
        self.sweep_pending = True
        self.led = self.leading  # not if leadership went elsewhere while the upstreams were asked
        return adapters

    def loaded_on(self, version: int, adapters: Mapping[str, Collection[str]]) -> None:
        """The leader loaded ``version`` (on the upstreams whose adapters, url -> served names, list it)."""
        self.loaded[version] = self.where(version, adapters)

    def replicas_changed(self, adapters: Mapping[str, Collection[str]]) -> bool:
        """Bring each loaded version's replicas up to date with the upstreams' adapters; True if any changed."""
        where = {v: self.where(v, adapters) for v in self.loaded}
        changed = where != self.loaded
        self.loaded.update(where)
        return changed

    def written(self, offset: int, retiring: Iterable[int]) -> None:
        """A state of this gateway's, naming ``retiring``, reached the log at ``offset``: the versions it named
        for the first time may be unloaded once every live gateway has read that far."""
        for v in retiring:
            if self.retiring.get(v, 0) is NOT_WRITTEN:
                self.retiring[v] = offset

    def unloaded(self, version: int) -> None:
        """The leader unloaded ``version`` everywhere (its ``unloading`` mark is the caller's to clear)."""
        self.loaded.pop(version, None)
        self.retiring.pop(version, None)

    # -- decisions -----------------------------------------------------------------------------------
    def where(self, version: int, adapters: Mapping[str, Collection[str]]) -> LoadedVersion:
        name = self.served(version)
        return LoadedVersion(version, tuple(url for url, names in adapters.items() if name in names))

    def adapters_of(self, url: str) -> set[str]:
        """What a follower takes an upstream to hold: the leader's loaded versions it names that upstream for."""
        return {self.served(v) for v, lv in self.loaded.items() if url in lv.replicas}

    def to_load(self) -> int | None:
        """The version the leader loads next (``version_to_load``); None while it has not taken over."""
        if not (self.leading and self.led):
            return None
        return version_to_load(self.records, self.loaded, self.refused)

    def room(self) -> bool:
        """A version may be loaded now without passing ``max_loaded`` (else it waits for an unload)."""
        return len(self.loaded) < self.max_loaded

    def to_route(self, known: Collection[int], healthy: Collection[str]) -> int | None:
        return version_to_route(self.loaded, self.retiring, known, healthy)

    def to_retire(self, routed: int | None, held: Collection[int] = ()) -> list[int]:
        """The leader retires what ``versions_to_retire`` names (marked not yet written); returns them."""
        if not (self.leading and self.led):
            return []
        retire = versions_to_retire(self.loaded, self.retiring, routed, self.keep_previous, held)
        for v in retire:
            self.retiring[v] = NOT_WRITTEN
        return retire

    def to_unload(self, peers: Iterable[Peer], held_here: Collection[int], routed: int | None) -> list[int]:
        """Retiring versions to unload now (``versions_to_unload``), marked as under way."""
        ready = versions_to_unload(self.retiring, peers, held_here, routed, self.unloading)
        self.unloading.update(ready)
        return ready

    def to_sweep(self, listed: Iterable[str]) -> list[str]:
        """Once after a take-over, when the policy topic is read: the adapters no leader owns (``orphans``)."""
        if not (self.sweep_pending and self.caught_up):
            return []
        self.sweep_pending = False
        return orphans(listed, self.policy_name, self.loaded)

    def written_view(self) -> tuple[tuple[LoadedVersion, ...], tuple[int, ...]]:
        """``loaded`` and ``retiring`` as this gateway's state carries them (empty from a follower)."""
        if not self.leading:
            return (), ()
        return tuple(self.loaded[v] for v in sorted(self.loaded)), tuple(sorted(self.retiring))
