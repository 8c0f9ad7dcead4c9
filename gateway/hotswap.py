"""Follow the policy topic and hot-swap each published adapter version into every upstream, together with
the other gateways in front of the same upstreams.

The policy topic is trusted input only as far as it is checked: a record from a publisher not in
``trusted_publishers`` (when set), whose adapter directory or any file in it resolves (symlinks followed)
outside ``adapter_root`` (when set), or whose weights do not hash to its sha256 is refused, counted in
``streamrl_gateway_policy_rejected_total{reason}`` and logged once; nothing of it reaches an upstream.

Several gateways (processes, hosts) share the upstreams through the coordination log
(``coordination.py``; the protocol is stated in docs/gateway.md, "Several gateways"). One of them, the
leader, loads and unloads; every gateway, the leader too, routes the policy name to the newest version
the leader's state says is loaded:

* Leader, for a new version: check the record as above, load it into every healthy upstream under its
  own name (``<name>@v<N>``, never reused; "already loaded" counts as loaded), write its state with the
  version in ``loaded``, then route to it in one assignment (see ``policy.py``).
* Every gateway, on reading the leader's state: route to the newest ``loaded`` version on an upstream it
  sees healthy; versions in ``retiring`` take no new requests (a pinned one gets a 404).
* Leader, for a version older than the ``keep_previous_versions`` before the routed one: put it in
  ``retiring``, and unload it once every live gateway has written a state that had read that and has no
  request on it (``in_use``); requests already running finish on their version.
* A gateway that becomes leader (the old one left or went silent for ``gateway_ttl_s``) takes over the
  last ``loaded``/``retiring`` a leader wrote, checks them against what the upstreams list, loads what is
  missing (the version a dead leader was loading, idempotently), and unloads adapters of its policy name
  that no leader lists (a dead leader's half-done loads of versions since overtaken).

An upstream that fails to load the routed version (or comes back empty after a restart) is retried by the
leader and gets no policy requests until it has it.

What this gateway knows of the versions, and every decision that needs no I/O (what to route, load, retire,
unload, sweep), is ``swap_plan.SwapPlan``'s, which also draws a version's life; this class gathers the events,
hands them to the plan, and carries out what it decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import aiohttp
import orjson

from streamrl.broker.schema import GatewayState, PolicyRecord, RecordError, decode
from streamrl.engine.wire import CAPTURE_HEADER, FOLLOW_HEADER, FOLLOW_KEEP, FOLLOW_RECOMPUTE
from streamrl.gateway.tail_process import Records, Tail

from .config import GatewayConfig
from .coordination import Coordination
from .dashboard import PolicyBoard
from .metrics import GatewayMetrics
from .policy import PolicyRouter, VersionState
from .swap_plan import Peer, SwapPlan
from .trust import PolicyRejected, check_adapter, check_publisher
from .upstreams import Upstream, UpstreamPool

log = logging.getLogger(__name__)

_CAUGHT_UP = object()
"""Put on the queue once the policy topic has been read to its end."""
_WAKE = object()
"""Put on the queue when this gateway has become the leader: look for a version to load."""
LOAD_SETTLE_S = 3.0
"""How long a stopping gateway lets its adapter loads in flight end (they take milliseconds to a second): vLLM
stopped in the middle of a load hangs on it (its API server waits for the load's handler, whose engine core is
gone) until killed, and ``streamrl up`` stops the engines right after the gateway."""


class PolicyFollower:
    """One policy's hot-swap in this gateway: reads the policy topic and the coordination view into its
    ``SwapPlan`` and carries out what the plan decides (loads, routing, state writes, unloads)."""

    def __init__(self, config: GatewayConfig, pool: UpstreamPool, router: PolicyRouter,
                 session: aiohttp.ClientSession, topic: str, metrics: GatewayMetrics,
                 coordination: Coordination, dashboard: PolicyBoard | None = None) -> None:
        self.config, self.pool, self.router, self.session = config, pool, router, session
        self.topic, self.metrics, self.dashboard = topic, metrics, dashboard
        self.coordination = coordination
        self.caught_up = asyncio.Event()
        self.rejected = 0
        self.plan = SwapPlan(router.name, config.max_loaded_versions, config.keep_previous_versions)
        self._loading_state: VersionState | None = None
        self._written: tuple[tuple[int, ...], tuple[int, ...]] | None = None
        self._write_lock = asyncio.Lock()
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._room = asyncio.Event()
        self._arrived = asyncio.Event()
        """Set when something is queued: a load waiting for room gives way to a newer version."""
        self._reconcile_now = asyncio.Event()
        self._loading: set[tuple[str, str]] = set()
        self._no_loads = asyncio.Event()
        """Set while no adapter load is in flight."""
        self._no_loads.set()
        self._stopping = False
        self._tasks: set[asyncio.Task[None]] = set()
        router.idle_callbacks.append(self._on_idle)
        pool.on_recovered.append(lambda _up: self._reconcile_now.set())

    # -- life cycle ----------------------------------------------------------------------------------
    async def start(self, catch_up_timeout_s: float = 30.0) -> None:
        """Join the coordination log, then follow the policy topic; return once the newest version the
        leader has loaded (this gateway's own first load, when it leads) is routed, or after the timeout."""
        self.coordination.on_change.append(self._on_coordination)
        joining = asyncio.get_running_loop().create_task(self._join())
        self._tasks.add(joining)
        joining.add_done_callback(self._tasks.discard)
        started = time.monotonic()
        await asyncio.wait({joining}, timeout=catch_up_timeout_s)
        if not joining.done():
            log.warning("coordination topic not read back after %.0fs; serving on (this gateway joins the others "
                        "when Kafka answers)", catch_up_timeout_s)
        catch_up_timeout_s = max(0.0, catch_up_timeout_s - (time.monotonic() - started))
        self.coordination.tails.subscribe(Tail(self.topic), self._read, lambda: self._enqueue(_CAUGHT_UP))
        self._spawn(self._run())
        self._spawn(self._reconcile())
        self._spawn(self._heartbeat())
        try:
            async with asyncio.timeout(catch_up_timeout_s):
                await self.caught_up.wait()
        except TimeoutError:
            log.warning("policy topic %s not caught up after %.0fs; serving on", self.topic, catch_up_timeout_s)

    async def _join(self) -> None:
        await self.coordination.start(self._state())
        self._on_coordination()

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Let the adapter loads in flight end (``LOAD_SETTLE_S`` at most; no new one starts), then cancel the
        loops and wait for them, bounded: a loop that failed to end must not keep the gateway (and the records its
        producer holds) from stopping."""
        self._stopping = True
        if not self._no_loads.is_set():
            loads = ", ".join(f"{name} into {url}" for url, name in sorted(self._loading))
            log.info("stopping: letting the adapter loads in flight end first (%s)", loads)
            try:
                async with asyncio.timeout(LOAD_SETTLE_S):
                    await self._no_loads.wait()
            except TimeoutError:
                log.warning("adapter loads still in flight %.0f s into the stop: left (%s)", LOAD_SETTLE_S, loads)
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=timeout_s)
            for task in done:  # retrieved: what a loop raised was logged where it happened
                if not task.cancelled():
                    task.exception()
            for task in pending:
                log.error("hot-swap task %s did not end within %.0fs of its cancellation", task.get_coro(), timeout_s)
        leaving = self._state()
        leaving.leaving = True
        await self.coordination.stop(leaving if self.coordination.ready else None)

    def _spawn(self, coro: object) -> None:
        task = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- the policy topic, read by the tail process ---------------------------------------------------
    def _enqueue(self, item: object) -> None:
        self._queue.put_nowait(item)
        self._arrived.set()

    def _read(self, records: Records) -> None:
        for offset, value in records:
            try:
                record = decode(value)
            except RecordError as exc:
                self._reject("malformed", f"skipping bad policy record at offset {offset}: {exc}")
                continue
            if isinstance(record, PolicyRecord) and record.name == self.router.name:
                try:
                    check_publisher(record, self.config.trusted_publishers)
                except PolicyRejected as exc:
                    self._reject(exc.reason, f"not serving {record.served_name}: {exc}")
                    continue
                self._enqueue(record)

    def _reject(self, reason: str, message: str) -> None:
        """Count and log a refused record (once: each record is read once, by the leader's check once)."""
        self.rejected += 1
        self.metrics.policy_rejected.labels(reason).inc()
        log.error("%s", message)

    # -- the coordination view -----------------------------------------------------------------------
    def in_use(self) -> tuple[int, ...]:
        """The versions this gateway routes or holds (requests in flight, a pinned one just ended)."""
        versions = self.router.held()
        if self.router.routed is not None:
            versions.add(self.router.version)
        return tuple(sorted(versions))

    @property
    def leading(self) -> bool:
        return self.plan.leading

    def _state(self) -> GatewayState:
        c = self.coordination
        loaded, retiring = self.plan.written_view()
        return GatewayState(gateway_id=c.gateway_id, policy_name=self.router.name, joined_offset=c.joined_offset,
                            seen_offset=c.applied_offset, routed_version=self.router.version, in_use=self.in_use(),
                            loaded=loaded, retiring=retiring, leader=self.leading)

    def _adapters(self) -> dict[str, set[str]]:
        return {u.url: u.adapters for u in self.pool.upstreams}

    async def _publish(self) -> None:
        """Write this gateway's state now (serialised: states of one gateway reach the log in order)."""
        async with self._write_lock:
            state = self._state()
            self._written = (state.in_use, tuple(sorted(self.plan.retiring)))
            try:
                offset = await self.coordination.write(state)
            except Exception as exc:
                log.warning("could not write the gateway state: %s", exc)
                return
            self.plan.written(offset, state.retiring)
        if self.leading:
            self._check_retiring()

    def _changed(self) -> None:
        """Write the state at once when what this gateway uses, or the retiring set it has read, changed."""
        if self.coordination.ready and self._written != (self.in_use(), tuple(sorted(self.plan.retiring))):
            self._spawn(self._publish())

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_s)
            if self.coordination.ready:
                self._on_coordination()  # a silent gateway goes out of the view with time alone
                await self._publish()

    def _on_coordination(self) -> None:
        was = self.leading
        became = self.plan.lead(self.coordination.leading)
        self.metrics.leader.labels(self.router.name).set(float(self.leading))
        if became:
            self._spawn(self._take_over())
        elif not self.leading:
            if was:
                log.warning("an older gateway is live: %s leads, this gateway follows",
                            self.coordination.leader())
            seen = self.coordination.state_of(self.coordination.leader())
            self.plan.follow(seen.state if seen is not None else None)
            self._route()
        else:
            self._check_retiring()
        self._changed()

    async def _take_over(self) -> None:
        """Become the leader: take what the last leader wrote, check it against the upstreams' lists."""
        log.info("gateway %s leads (live: %s)", self.coordination.gateway_id,
                 ", ".join(s.gateway_id for s in self.coordination.live()))
        last = max((s for s in self.coordination.seen.values()
                    if s.state.leader and s.state.gateway_id != self.coordination.gateway_id),
                   key=lambda s: s.offset, default=None)
        self.plan.take_over(last.state if last is not None else None)
        await self.pool.check_all()  # what every upstream lists now
        adapters = self.plan.confirm({u.url: set(u.models) for u in self.pool.upstreams},
                                     any(u.healthy for u in self.pool.upstreams))
        for up in self.pool.upstreams:
            up.adapters = adapters[up.url]
        await self._publish()
        self._route()
        self._trim()
        self._enqueue(_WAKE)

    # -- routing (every gateway) ---------------------------------------------------------------------
    def _route(self) -> None:
        """Route to the newest loaded version (not retiring) on an upstream seen healthy; keep the routing
        table's versions to the loaded ones."""
        plan = self.plan
        if not self.leading:
            for up in self.pool.upstreams:
                up.adapters = plan.adapters_of(up.url)
        for v in plan.loaded:
            if v in plan.records and v not in self.router.versions:
                self.router.versions[v] = VersionState(plan.records[v], loaded_at=time.time())
        for v, state in list(self.router.versions.items()):
            if state is self._loading_state:
                continue
            if v not in plan.loaded:
                state.unloading = True
                if state.in_flight == 0 and state is not self.router.routed:
                    del self.router.versions[v]
            elif v in plan.retiring:
                state.retiring = True
        v = plan.to_route(self.router.versions, [u.url for u in self.pool.upstreams if u.healthy])
        if v is not None and v != self.router.version:
            self._switch(self.router.versions[v])

    def _switch(self, state: VersionState) -> None:
        now = time.time()
        old = self.router.route(state)
        self.metrics.swaps.labels(self.router.name).inc()
        self.metrics.publish_to_route.labels(self.router.name).observe(max(0.0, now - state.record.created))
        if self.dashboard is not None:
            self.dashboard.routed(state.record.version, now)
        log.info("policy %r now served by %s (was %s), %.0f ms after publication", self.router.name,
                 state.served_name, old.served_name if old else "the base model",
                 (now - state.record.created) * 1000)
        if self.config.update_mode == "in-flight":
            self._spawn(self._announce(state))

    async def _announce(self, state: VersionState) -> None:
        """In the in-flight update mode, tell each engine that moves requests that ``served`` is routed now, not
        at the first request this gateway happens to send on it: one marked request of one token, the signal the
        engine's scheduler takes (``engine/inflight.py``), so that the requests running on older versions move at
        its next step even while no new request comes (a quiet agent; a synchronous batch waiting for its
        longest reply). Its answer moves the leases of the marked requests sent to that engine before it, as
        any marked answer does (``Lease.reached_engine``). A failure costs only that wait: logged at debug level."""
        served = state.served_name
        follow = FOLLOW_RECOMPUTE if self.config.in_flight_cache == "recompute" else FOLLOW_KEEP
        headers = {CAPTURE_HEADER: "1", FOLLOW_HEADER: follow}
        body = {"model": served, "prompt": ".", "max_tokens": 1}

        async def one(up: Upstream) -> None:
            sent_before = self.router.marked_sent + 1
            try:
                async with self.session.post(f"{up.url}/v1/completions", json=body, headers=headers,
                                             timeout=aiohttp.ClientTimeout(total=30)) as r:
                    await r.read()
                    if r.status != 200:
                        raise RuntimeError(f"HTTP {r.status}")
                self.metrics.route_announcements.labels(self.router.name).inc()
                if self.router.versions.get(state.record.version) is state:  # not dropped meanwhile
                    self.router.moved_forward(up.url, sent_before, state)
            except Exception as exc:
                log.debug("announcing %s to %s failed (%s): its running requests move at the next request on it",
                          served, up.url, exc)

        await asyncio.gather(*(one(up) for up in self.pool.upstreams
                               if up.healthy and up.moves_requests and up.serves(served)))

    # -- swapping (the leader) -----------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            items = [await self._queue.get()]
            while not self._queue.empty():
                items.append(self._queue.get_nowait())
            for record in (i for i in items if isinstance(i, PolicyRecord)):
                self.plan.published(record)
                if self.dashboard is not None:  # every version's trainer metrics, the skipped ones' too
                    self.dashboard.published(record)
            if any(i is _CAUGHT_UP for i in items):
                self.plan.caught_up = True
            if self.leading and self.plan.led:
                try:
                    await self._lead()
                except Exception:
                    log.exception("leading the swap failed")
            else:
                self._route()
            if self.plan.caught_up:
                self.caught_up.set()

    async def _lead(self) -> None:
        while (v := self.plan.to_load()) is not None:
            if not await self._swap_to(self.plan.records[v]) or not self._queue.empty():
                break
        for name in self.plan.to_sweep(m for u in self.pool.upstreams for m in u.models):
            await self._unload_name(name)
            log.info("unloaded %s (loaded by a leader that is gone, never routed)", name)

    async def _swap_to(self, record: PolicyRecord) -> bool:
        """Load ``record`` everywhere and route to it; False when refused or given up for a newer one."""
        t0 = time.time()
        name = record.served_name
        try:
            await asyncio.to_thread(check_adapter, record, self.config.adapter_root)
        except PolicyRejected as exc:
            self.plan.refuse(record.version)
            self._reject(exc.reason, f"not serving {name}: {exc}")
            return False
        while not self.plan.room():
            if not self._queue.empty():  # maybe a newer version: the loop takes it and loads the newest
                return False
            log.info("%s waits for an older version to drain (%d loaded)", name, len(self.plan.loaded))
            self._room.clear()
            self._arrived.clear()
            waits = [asyncio.ensure_future(event.wait()) for event in (self._room, self._arrived)]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
        t1 = time.time()
        state = VersionState(record)
        self._loading_state = state
        self.router.versions[record.version] = state
        try:
            while not await self._load_everywhere(state):
                if not self._queue.empty():  # a newer version is waiting: give this one up
                    await self._unload(state, "a newer version arrived while it was loading")
                    return False
                await asyncio.sleep(self.config.load_retry_s)
        finally:
            self._loading_state = None
        state.loaded_at = time.time()
        self.plan.loaded_on(record.version, self._adapters())
        await self._publish()
        self._route()
        self._trim()
        log.info("%s loaded on %s: received %.0f ms after publication, verified in %.0f ms, loaded in %.0f ms",
                 name, ", ".join(self.plan.loaded[record.version].replicas), (t0 - record.created) * 1000,
                 (t1 - t0) * 1000, (state.loaded_at - t1) * 1000)
        return True

    async def _load_everywhere(self, state: VersionState) -> bool:
        """Load into every healthy upstream; True when at least one has it."""
        ups = [u for u in self.pool.upstreams if u.healthy]
        await asyncio.gather(*(self._load(u, state) for u in ups))
        return any(state.served_name in u.adapters for u in self.pool.upstreams)

    async def _load(self, up: Upstream, state: VersionState) -> bool:
        name = state.served_name
        if name in up.adapters:
            return True
        key = (up.url, name)
        if key in self._loading or self._stopping:
            return False
        self._loading.add(key)
        self._no_loads.clear()
        try:
            body = {"lora_name": name, "lora_path": state.record.path}
            async with self.session.post(f"{up.url}/v1/load_lora_adapter", json=body,
                                         timeout=aiohttp.ClientTimeout(total=60)) as r:
                text = await r.text()
                already = r.status == 400 and "already" in text
            if r.status != 200 and not already:
                raise RuntimeError(f"HTTP {r.status}: {text[:200]}")
            self.metrics.adapter_loads.labels("already" if already else "loaded").inc()
            if state.unloading:  # given up while loading: take it out again
                await self._unload_one(up, name)
                return False
            up.adapters.add(name)
            return True
        except Exception as exc:
            self.metrics.adapter_load_failures.inc()
            log.warning("loading %s into %s failed (%s); will retry", name, up.url, exc)
        finally:
            self._loading.discard(key)
            if not self._loading:
                self._no_loads.set()
        return False

    async def _reconcile(self) -> None:
        """Leader: retry the routed version on upstreams that lack it (failed load, restart), and keep the
        replicas of each loaded version in its state as they are."""
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.load_retry_s):
                    await self._reconcile_now.wait()
            self._reconcile_now.clear()
            routed = self.router.routed
            if not self.leading or not self.plan.led or routed is None:
                continue
            missing = [u for u in self.pool.upstreams if u.healthy and routed.served_name not in u.adapters]
            if missing:
                await asyncio.gather(*(self._load(u, routed) for u in missing))
            if self.plan.replicas_changed(self._adapters()):
                await self._publish()

    # -- unloading (the leader) ----------------------------------------------------------------------
    def _on_idle(self, _state: VersionState) -> None:
        if self.leading:
            self._trim()
            self._check_retiring()
        self._changed()

    def _trim(self) -> None:
        """Retire the loaded versions older than the ``keep_previous_versions`` newest ones before the
        routed version (after each swap, and when a version no longer routed drains)."""
        routed = self.router.routed
        if routed is None:
            return
        retire = self.plan.to_retire(routed.record.version, self.router.held())
        for v in retire:
            state = self.router.versions.get(v)
            if state is not None:
                state.retiring = True  # pinned requests resolve to it only while it is held now
        if retire:
            self._spawn(self._publish())

    def _check_retiring(self) -> None:
        """Unload each retiring version every live gateway has let go of."""
        peers = [Peer(s.seen_offset, s.in_use) for s in self.coordination.live()
                 if s.gateway_id != self.coordination.gateway_id]
        for v in self.plan.to_unload(peers, self.router.held(), self.router.version):
            self._spawn(self._retire(v))

    async def _retire(self, version: int) -> None:
        records = self.plan.records
        state = self.router.versions.get(version) or (
            VersionState(records[version]) if version in records else None)
        try:
            if state is None:
                await self._unload_name(self.plan.served(version))
            else:
                routed = self.router.routed.served_name if self.router.routed else "-"
                await self._unload(state, f"retired, no gateway uses it, {routed} routed")
            self.plan.unloaded(version)
            self._room.set()
            await self._publish()
        finally:
            self.plan.unloading.discard(version)

    async def _unload(self, state: VersionState, reason: str) -> None:
        state.unloading = True
        await self._unload_name(state.served_name)
        if self.router.versions.get(state.record.version) is state:
            self.router.versions.pop(state.record.version, None)
        self._room.set()
        log.info("unloaded %s (%s)", state.served_name, reason)

    async def _unload_name(self, name: str) -> None:
        holders = [u for u in self.pool.upstreams if name in u.adapters or name in u.models]
        for u in holders:
            u.adapters.discard(name)
        await asyncio.gather(*(self._unload_one(u, name) for u in holders))

    async def _unload_one(self, up: Upstream, name: str) -> None:
        try:
            async with self.session.post(f"{up.url}/v1/unload_lora_adapter", data=orjson.dumps({"lora_name": name}),
                                         headers={"Content-Type": "application/json"},
                                         timeout=aiohttp.ClientTimeout(total=30)) as r:
                if r.status != 200:
                    log.warning("unloading %s from %s: HTTP %d %s", name, up.url, r.status, await r.text())
        except Exception as exc:  # an upstream that is down has lost it anyway
            log.warning("unloading %s from %s failed: %s", name, up.url, exc)
