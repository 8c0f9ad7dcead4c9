"""The routing table of the policy name: which adapter version serves it, and what is in flight where.

Clients ask for the stable policy name. ``resolve`` turns it into the engine-side model that serves it
now (the adapter ``<name>@v<N>`` of the routed version, or the base model before the first version)
and hands out a ``Lease`` that counts the request against that version until it finishes. Swapping
is one assignment on the event loop, so it is atomic for every request: those already holding a lease
finish on their version, the next ``resolve`` gets the new one. ``hotswap.py`` drives the swaps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from streamrl.broker.schema import PolicyRecord

from .upstreams import UpstreamPool


@dataclass(slots=True, eq=False)
class VersionState:
    record: PolicyRecord
    in_flight: int = 0
    unloading: bool = False
    loaded_at: float = field(default=0.0)

    @property
    def served_name(self) -> str:
        return self.record.served_name


class Lease:
    """One request's hold on the model that serves it. ``release()`` exactly once when done."""

    __slots__ = ("_router", "_state", "engine_model", "follows", "policy_name", "version")

    def __init__(self, router: PolicyRouter | None, state: VersionState | None, engine_model: str,
                 policy_name: str | None, version: int, follows: bool = False) -> None:
        self._router, self._state = router, state
        self.engine_model, self.policy_name, self.version = engine_model, policy_name, version
        self.follows = follows
        """Routed by the policy's name to a version (not pinned to one): in the ``in-flight`` update mode the
        request may move to a newer version while it runs."""
        if state is not None:
            state.in_flight += 1

    def release(self) -> None:
        state, self._state = self._state, None
        if state is not None and self._router is not None:
            state.in_flight -= 1
            if state.in_flight == 0:
                self._router.on_idle(state)


class PolicyRouter:
    def __init__(self, name: str, pool: UpstreamPool) -> None:
        self.name = name
        self.pool = pool
        self.routed: VersionState | None = None
        self.versions: dict[int, VersionState] = {}
        """Versions loaded (or being loaded/unloaded) somewhere, by version number."""
        self.idle_callbacks: list[Callable[[VersionState], None]] = []

    @property
    def version(self) -> int:
        return 0 if self.routed is None else self.routed.record.version

    def resolve(self, model: str) -> Lease | None:
        """The lease for a client's model name; None when no upstream knows it (a 404)."""
        own = self.resolve_own(model)
        if own is not None:
            return own
        if self.pool.known_model(model):
            return Lease(None, None, model, None, 0)
        return None

    def resolve_own(self, model: str) -> Lease | None:
        """The lease when ``model`` is this policy's name or a loaded version of it (``<name>@v<N>``), else None."""
        if model == self.name:
            routed = self.routed
            if routed is None:
                base = self.pool.base_models()
                return Lease(None, None, base[0], self.name, 0) if base else None
            return Lease(self, routed, routed.served_name, self.name, routed.record.version, follows=True)
        for state in self.versions.values():  # a pinned version, e.g. "policy@v3", while loaded
            if state.served_name == model and state.loaded_at and not state.unloading:
                return Lease(self, state, model, self.name, state.record.version)
        return None

    def route(self, state: VersionState) -> VersionState | None:
        """Point the policy name at ``state``; returns the version it replaces."""
        old, self.routed = self.routed, state
        self.versions[state.record.version] = state
        if old is not None and old.in_flight == 0:
            self.on_idle(old)
        return old

    def on_idle(self, state: VersionState) -> None:
        if state is not self.routed:
            for callback in self.idle_callbacks:
                callback(state)

    def state(self) -> dict[str, object]:
        return {"name": self.name, "version": self.version,
                "loaded": {s.served_name: {"in_flight": s.in_flight, "unloading": s.unloading}
                           for s in self.versions.values()}}


class PolicyTable:
    """Several policies served from the same upstreams, each its own ``PolicyRouter`` (routed version, loaded
    versions, hot-swap): the request's ``model`` picks the policy. The first is the gateway's default
    (``policy_name``), the one its dashboard and ``/health``'s ``policy`` show."""

    def __init__(self, names: tuple[str, ...], pool: UpstreamPool) -> None:
        if not names or len(set(names)) != len(names):
            raise ValueError(f"policy names must be given, each once: {names!r}")
        self.pool = pool
        self.routers = {name: PolicyRouter(name, pool) for name in names}
        self.default = self.routers[names[0]]

    def __iter__(self):
        return iter(self.routers.values())

    def resolve(self, model: str) -> Lease | None:
        """The lease for a client's model name: a policy's name or pinned version, else a model an upstream
        serves as it is (the base model, an adapter loaded by hand); None: a 404."""
        for router in self.routers.values():
            lease = router.resolve_own(model)
            if lease is not None:
                return lease
        if self.pool.known_model(model):
            return Lease(None, None, model, None, 0)
        return None
