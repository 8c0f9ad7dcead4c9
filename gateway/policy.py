"""The routing table of the policy name: which adapter version serves it, and what is in flight where.

Clients ask for the stable policy name. ``resolve`` turns it into the engine-side model that serves it
now (the adapter ``<name>@v<N>`` of the routed version, or the base model before the first version)
and hands out a ``Lease`` that counts the request against that version until it finishes. Swapping
is one assignment on the event loop, so it is atomic for every request: those already holding a lease
finish on their version, the next ``resolve`` gets the new one. ``hotswap.py`` drives the swaps.

In the ``in-flight`` update mode an engine moves running requests to the newest version (``engine/inflight.py``),
and a lease then follows its request (``Lease.reached_engine``): otherwise every older version would stay
counted, so loaded, until its longest reply ended, and a new version would wait for room behind it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from streamrl.broker.schema import PolicyRecord

from .upstreams import UpstreamPool


@dataclass(slots=True, eq=False)
class VersionState:
    record: PolicyRecord
    in_flight: int = 0
    retiring: bool = False
    """Retired by the leader: new requests pinned to it are served only while it is held (``held``)."""
    unloading: bool = False
    """Its unload is under way (or its load was given up): no new request reaches it."""
    loaded_at: float = field(default=0.0)
    pinned: dict[str, float] = field(default_factory=dict)
    """Episodes (trajectory ids) whose request pinned to it ended, each with the ``time.monotonic()`` until
    which that keeps it held (``PolicyRouter.pinned_hold_s``), unless the episode ends first (``end_episodes``)."""

    @property
    def served_name(self) -> str:
        return self.record.served_name

    def held(self, now: float) -> bool:
        """Requests run on it, or one pinned to it ended a moment ago: the next call of a multi-call episode
        pinned to it (an evaluation's, an agent's) is on its way, so it is neither unloaded nor closed to it."""
        return self.in_flight > 0 or any(now < until for until in self.pinned.values())


class Lease:
    """One request's hold on the model that serves it. ``release()`` exactly once when done."""

    __slots__ = ("_router", "_state", "engine_model", "follows", "marked_on", "policy_name", "sent", "trajectory_id",
                 "version")

    def __init__(self, router: PolicyRouter | None, state: VersionState | None, engine_model: str,
                 policy_name: str | None, version: int, follows: bool = False, trajectory_id: str = "") -> None:
        self._router, self._state = router, state
        self.engine_model, self.policy_name, self.version = engine_model, policy_name, version
        self.trajectory_id = trajectory_id
        """The episode the request belongs to: a pinned request's hold after it ends is that episode's."""
        self.follows = follows
        """Routed by the policy's name to a version (not pinned to one): in the ``in-flight`` update mode the
        request may move to a newer version while it runs."""
        self.marked_on: str | None = None
        """The upstream this request went to marked to move (``mark``), else None."""
        self.sent = 0
        """Its place in the order in which marked requests were sent (``mark``)."""
        if state is not None:
            state.in_flight += 1

    @property
    def holds(self) -> int:
        """The version this lease counts against (a newer one than ``version`` once its request moved)."""
        return 0 if self._state is None else self._state.record.version

    def mark(self, upstream: str) -> None:
        """The request is being sent to ``upstream`` marked to move to its policy's newest version."""
        if self._router is not None and self._state is not None:
            self.marked_on = upstream
            self.sent = self._router.sent_marked(self)

    def reached_engine(self) -> None:
        """An output of this marked request came back, so its engine has seen a marked request on this
        version: from that step on it runs every marked request of the policy sent before on this version
        (``MovePlanner``), and their leases move here, letting the older versions drain. Only those sent
        earlier move: one still on its way to the engine must find its version loaded there."""
        if self.marked_on is not None and self._router is not None and self._state is not None:
            self._router.moved_forward(self.marked_on, self.sent, self._state)

    def _hold(self, state: VersionState) -> None:
        old, self._state = self._state, state
        state.in_flight += 1
        if old is not None:
            self._let_go(old)

    def _let_go(self, state: VersionState) -> None:
        state.in_flight -= 1
        if state.in_flight == 0 and self._router is not None:
            self._router.on_idle(state)

    def release(self) -> None:
        state, self._state = self._state, None
        if state is not None and self._router is not None:
            self._router.unmark(self, state.record.version)
            if not self.follows:
                self._router.hold_pinned(state, self.trajectory_id)
            self._let_go(state)


class PolicyRouter:
    def __init__(self, name: str, pool: UpstreamPool, pinned_hold_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.pool = pool
        self.pinned_hold_s = pinned_hold_s
        """How long a version stays held after a request pinned to it ended (``VersionState.held``)."""
        self.clock = clock
        self.routed: VersionState | None = None
        self.versions: dict[int, VersionState] = {}
        """Versions loaded (or being loaded/unloaded) somewhere, by version number."""
        self.idle_callbacks: list[Callable[[VersionState], None]] = []
        self.marked: dict[Lease, None] = {}
        """Leases of requests in flight that were sent marked to move (``Lease.mark``), in the order sent."""
        self._marked_versions: Counter[int] = Counter()
        """How many marked leases hold each version: a request's answer looks through ``marked`` only when
        some of them hold an older version than its own, not on every call."""
        self._sent = 0
        self.moved_leases = 0
        """Leases that followed their request to a newer version (``moved_forward``)."""

    @property
    def version(self) -> int:
        return 0 if self.routed is None else self.routed.record.version

    def resolve(self, model: str, trajectory_id: str = "") -> Lease | None:
        """The lease for a client's model name; None when no upstream knows it (a 404)."""
        own = self.resolve_own(model, trajectory_id)
        if own is not None:
            return own
        if self.pool.known_model(model):
            return Lease(None, None, model, None, 0)
        return None

    def resolve_own(self, model: str, trajectory_id: str = "") -> Lease | None:
        """The lease when ``model`` is this policy's name or a loaded version of it (``<name>@v<N>``), else None;
        ``trajectory_id``: the request's episode (whose pinned hold the lease's end starts)."""
        if model == self.name:
            routed = self.routed
            if routed is None:
                base = self.pool.base_models()
                return Lease(None, None, base[0], self.name, 0) if base else None
            return Lease(self, routed, routed.served_name, self.name, routed.record.version, follows=True)
        for state in self.versions.values():  # a pinned version, e.g. "policy@v3", while loaded (and held if retired)
            if state.served_name == model and state.loaded_at and not state.unloading \
                    and (not state.retiring or state.held(self.clock())):
                return Lease(self, state, model, self.name, state.record.version, trajectory_id=trajectory_id)
        return None

    def held(self) -> set[int]:
        """The versions held now (``VersionState.held``)."""
        now = self.clock()
        return {v for v, s in self.versions.items() if s.held(now)}

    def hold_pinned(self, state: VersionState, episode: str) -> None:
        """A request of ``episode`` pinned to ``state`` ended: hold it for that episode ``pinned_hold_s`` longer
        (its next call is on its way) or until the episode ends (``end_episodes``), then look at it again (an
        idle retiring version may be unloaded then)."""
        if self.pinned_hold_s <= 0:
            return
        state.pinned[episode] = self.clock() + self.pinned_hold_s
        with contextlib.suppress(RuntimeError):  # no event loop: nothing to look at later (a unit test's lease)
            asyncio.get_running_loop().call_later(self.pinned_hold_s, self._hold_ended, state, episode)

    def _hold_ended(self, state: VersionState, episode: str) -> None:
        now = self.clock()
        until = state.pinned.get(episode)
        if until is not None and until <= now:
            del state.pinned[episode]
        if not state.held(now):
            self.on_idle(state)

    def end_episodes(self, episodes: Collection[str]) -> int:
        """These episodes (trajectory ids) ended (their reward was posted, or their client said so): the
        versions they pinned are no longer held for them, and one that nothing else holds is idle now, not
        ``pinned_hold_s`` later. Returns how many holds ended."""
        ended = 0
        for state in list(self.versions.values()):
            if not state.pinned:
                continue
            before = len(state.pinned)
            for episode in episodes:
                state.pinned.pop(episode, None)
            if len(state.pinned) < before:
                ended += before - len(state.pinned)
                if not state.held(self.clock()):
                    self.on_idle(state)
        return ended

    def route(self, state: VersionState) -> VersionState | None:
        """Point the policy name at ``state``; returns the version it replaces."""
        old, self.routed = self.routed, state
        self.versions[state.record.version] = state
        if old is not None and old.in_flight == 0:
            self.on_idle(old)
        return old

    def sent_marked(self, lease: Lease) -> int:
        self._sent += 1
        if self.marked.pop(lease, False) is False:  # else sent again (another upstream): its place is the new one
            self._marked_versions[lease.holds] += 1
        self.marked[lease] = None
        return self._sent

    @property
    def marked_sent(self) -> int:
        """How many marked requests were sent so far: ``moved_forward``'s ``sent_before`` for a signal sent now."""
        return self._sent

    def unmark(self, lease: Lease, version: int) -> None:
        if self.marked.pop(lease, False) is not False:
            self._count(version, -1)

    def _count(self, version: int, n: int) -> None:
        self._marked_versions[version] += n
        if not self._marked_versions[version]:
            del self._marked_versions[version]

    def moved_forward(self, upstream: str, sent_before: int, state: VersionState) -> None:
        """``upstream``'s engine runs the marked requests sent to it before ``sent_before`` on ``state``'s
        version or a newer one: the leases of those on older versions now count against ``state``."""
        version = state.record.version
        if not self._marked_versions or min(self._marked_versions) >= version:
            return  # nothing older to move: the common case, one check per answer
        for lease in list(self.marked):
            if lease.sent >= sent_before:
                break
            if lease.marked_on == upstream and lease.holds < version:
                self._count(lease.holds, -1)
                self._count(version, 1)
                lease._hold(state)
                self.moved_leases += 1

    def on_idle(self, state: VersionState) -> None:
        if state is not self.routed:
            for callback in self.idle_callbacks:
                callback(state)

    def state(self) -> dict[str, object]:
        return {"name": self.name, "version": self.version, "moved_leases": self.moved_leases,
                "loaded": {s.served_name: {"in_flight": s.in_flight, "retiring": s.retiring, "unloading": s.unloading}
                           for s in self.versions.values()}}


class PolicyTable:
    """Several policies served from the same upstreams, each its own ``PolicyRouter`` (routed version, loaded
    versions, hot-swap): the request's ``model`` picks the policy. The first is the gateway's default
    (``policy_name``), the one its dashboard and ``/health``'s ``policy`` show."""

    def __init__(self, names: tuple[str, ...], pool: UpstreamPool, pinned_hold_s: float = 0.0) -> None:
        if not names or len(set(names)) != len(names):
            raise ValueError(f"policy names must be given, each once: {names!r}")
        self.pool = pool
        self.routers = {name: PolicyRouter(name, pool, pinned_hold_s) for name in names}
        self.default = self.routers[names[0]]

    def __iter__(self):
        return iter(self.routers.values())

    def resolve(self, model: str, trajectory_id: str = "") -> Lease | None:
        """The lease for a client's model name: a policy's name or pinned version, else a model an upstream
        serves as it is (the base model, an adapter loaded by hand); None: a 404. ``trajectory_id``: the
        request's episode."""
        for router in self.routers.values():
            lease = router.resolve_own(model, trajectory_id)
            if lease is not None:
                return lease
        if self.pool.known_model(model):
            return Lease(None, None, model, None, 0)
        return None

    def end_episodes(self, episodes: Collection[str]) -> int:
        """``PolicyRouter.end_episodes`` for every policy."""
        return sum(router.end_episodes(episodes) for router in self.routers.values())
