"""Follow the policy topic and hot-swap each published adapter version into every upstream.

The policy topic is trusted input only as far as it is checked: a record from a publisher not in
``trusted_publishers`` (when set), whose adapter directory or any file in it resolves (symlinks followed)
outside ``adapter_root`` (when set), or whose weights do not hash to its sha256 is refused, counted in
``streamrl_gateway_policy_rejected_total{reason}`` and logged once; nothing of it reaches an upstream.

For a new version: check the record as above, load it into every healthy upstream under its
own name (``<name>@v<N>``, never reused), then route the policy name to it in one assignment (see
``policy.py``). Requests already running finish on their version; a version that is no longer routed is
unloaded once nothing is in flight on it and ``keep_previous_versions`` newer ones are loaded. An
upstream that fails to load the routed version (or comes back empty after a restart) is retried and gets
no policy requests until it has it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time

import aiohttp
import orjson
from kafka import TopicPartition

from streamrl.broker.clients import FETCH_MAX_WAIT_MS, make_consumer
from streamrl.broker.schema import PolicyRecord, RecordError, decode

from .config import GatewayConfig
from .dashboard import Dashboard
from .metrics import GatewayMetrics
from .policy import PolicyRouter, VersionState
from .trust import PolicyRejected, check_adapter, check_publisher
from .upstreams import Upstream, UpstreamPool

log = logging.getLogger(__name__)

_CAUGHT_UP = object()
"""Put on the queue by the consumer thread once it has read the topic to its end."""


class PolicyFollower:
    def __init__(self, config: GatewayConfig, pool: UpstreamPool, router: PolicyRouter,
                 session: aiohttp.ClientSession, topic: str, metrics: GatewayMetrics,
                 dashboard: Dashboard | None = None) -> None:
        self.config, self.pool, self.router, self.session = config, pool, router, session
        self.topic, self.metrics, self.dashboard = topic, metrics, dashboard
        self.caught_up = asyncio.Event()
        self.rejected = 0
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._room = asyncio.Event()
        self._reconcile_now = asyncio.Event()
        self._loading: set[tuple[str, str]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        router.idle_callbacks.append(self._on_idle)
        pool.on_recovered.append(lambda _up: self._reconcile_now.set())

    # -- life cycle ----------------------------------------------------------------------------------
    async def start(self, catch_up_timeout_s: float = 30.0) -> None:
        """Start following; return once the latest published version is routed (or after the timeout)."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._consume, name="policy-follower", daemon=True)
        self._thread.start()
        self._spawn(self._run())
        self._spawn(self._reconcile())
        try:
            await asyncio.wait_for(self.caught_up.wait(), catch_up_timeout_s)
        except TimeoutError:
            log.warning("policy topic %s not caught up after %.0fs; serving on", self.topic, catch_up_timeout_s)

    async def stop(self) -> None:
        self._stopping.set()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5)

    def _spawn(self, coro: object) -> None:
        task = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- the consumer thread (kafka-python blocks) ---------------------------------------------------
    def _deliver(self, item: object) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def _consume(self) -> None:
        consumer = None
        while consumer is None and not self._stopping.is_set():
            try:
                consumer = make_consumer(self.config.bootstrap_servers, group_id=None,  # type: ignore[arg-type]
                                         security=self.config.kafka, client_id="streamrl-gateway-policy")
            except Exception as exc:
                log.warning("policy follower cannot reach Kafka (%s); retrying", exc)
                self._stopping.wait(1.0)
        if consumer is None:
            return
        tp = TopicPartition(self.topic, 0)
        consumer.assign([tp])
        consumer.seek_to_beginning(tp)
        try:
            end = consumer.end_offsets([tp])[tp]
        except Exception:
            end = 0
        caught_up = False
        try:
            while not self._stopping.is_set():
                batches = consumer.poll(timeout_ms=FETCH_MAX_WAIT_MS)
                for message in batches.get(tp, ()):
                    try:
                        record = decode(message.value)
                    except RecordError as exc:
                        self._reject("malformed", f"skipping bad policy record at offset {message.offset}: {exc}")
                        continue
                    if isinstance(record, PolicyRecord) and record.name == self.router.name:
                        try:
                            check_publisher(record, self.config.trusted_publishers)
                        except PolicyRejected as exc:
                            self._reject(exc.reason, f"not serving {record.served_name}: {exc}")
                            continue
                        self._deliver(record)
                if not caught_up and not batches and consumer.position(tp) >= end:
                    caught_up = True
                    self._deliver(_CAUGHT_UP)
        finally:
            consumer.close()

    def _reject(self, reason: str, message: str) -> None:
        """Count and log a refused record (once: each record is read once)."""
        self.rejected += 1
        self.metrics.policy_rejected.labels(reason).inc()
        log.error("%s", message)

    # -- swapping ------------------------------------------------------------------------------------
    async def _run(self) -> None:
        while True:
            items = [await self._queue.get()]
            while not self._queue.empty():
                items.append(self._queue.get_nowait())
            records = [i for i in items if isinstance(i, PolicyRecord)]
            if self.dashboard is not None:
                for record in records:  # every version's trainer metrics, the skipped ones' too
                    self.dashboard.published(record)
            if records:
                newest = max(records, key=lambda r: r.version)
                if newest.version > self.router.version:
                    try:
                        await self._swap_to(newest)
                    except Exception:
                        log.exception("swap to %s failed", newest.served_name)
            if any(i is _CAUGHT_UP for i in items):
                self.caught_up.set()

    async def _swap_to(self, record: PolicyRecord) -> None:
        t0 = time.time()
        name = record.served_name
        try:
            await asyncio.to_thread(check_adapter, record, self.config.adapter_root)
        except PolicyRejected as exc:
            self._reject(exc.reason, f"not serving {name}: {exc}")
            return
        while len(self.router.versions) >= self.config.max_loaded_versions:
            log.info("%s waits for an older version to drain (%d loaded)", name, len(self.router.versions))
            self._room.clear()
            await self._room.wait()
        t1 = time.time()
        state = VersionState(record)
        self.router.versions[record.version] = state
        while not await self._load_everywhere(state):
            if not self._queue.empty():  # a newer version is waiting: give this one up
                await self._unload(state, "a newer version arrived while it was loading")
                return
            await asyncio.sleep(self.config.load_retry_s)
        state.loaded_at = time.time()
        old = self.router.route(state)
        self._trim()
        self.metrics.swaps.inc()
        self.metrics.publish_to_route.observe(max(0.0, state.loaded_at - record.created))
        if self.dashboard is not None:
            self.dashboard.routed(record.version, state.loaded_at)
        log.info("policy %r now served by %s (was %s): received %.0f ms after publication, verified in %.0f ms, "
                 "loaded in %.0f ms", self.router.name, name, old.served_name if old else "the base model",
                 (t0 - record.created) * 1000, (t1 - t0) * 1000, (state.loaded_at - t1) * 1000)

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
        if key in self._loading:
            return False
        self._loading.add(key)
        try:
            body = {"lora_name": name, "lora_path": state.record.path}
            async with self.session.post(f"{up.url}/v1/load_lora_adapter", json=body,
                                         timeout=aiohttp.ClientTimeout(total=60)) as r:
                text = await r.text()
                ok = r.status == 200 or (r.status == 400 and "already" in text)
            if not ok:
                raise RuntimeError(f"HTTP {r.status}: {text[:200]}")
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
        return False

    async def _reconcile(self) -> None:
        """Retry the routed version on upstreams that lack it (failed load, restart)."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._reconcile_now.wait(), self.config.load_retry_s)
            self._reconcile_now.clear()
            routed = self.router.routed
            if routed is None:
                continue
            missing = [u for u in self.pool.upstreams if u.healthy and routed.served_name not in u.adapters]
            if missing:
                await asyncio.gather(*(self._load(u, routed) for u in missing))

    # -- unloading -----------------------------------------------------------------------------------
    def _on_idle(self, _state: VersionState) -> None:
        self._trim()

    def _trim(self) -> None:
        """Unload the idle versions older than the ``keep_previous_versions`` newest ones before the
        routed version (after each swap, and when a version no longer routed drains)."""
        routed = self.router.routed
        if routed is None:
            return
        previous = sorted((s for s in self.router.versions.values()
                           if s is not routed and s.loaded_at and not s.unloading
                           and s.record.version < routed.record.version),
                          key=lambda s: s.record.version, reverse=True)
        for state in previous[self.config.keep_previous_versions:]:
            if state.in_flight == 0:
                state.unloading = True  # pinned requests stop resolving to it now, not when the task runs
                self._spawn(self._unload(state, f"no request in flight, {routed.served_name} routed"))

    async def _unload(self, state: VersionState, reason: str) -> None:
        state.unloading = True
        name = state.served_name
        holders = [u for u in self.pool.upstreams if name in u.adapters]
        for u in holders:
            u.adapters.discard(name)
        await asyncio.gather(*(self._unload_one(u, name) for u in holders))
        self.router.versions.pop(state.record.version, None)
        self._room.set()
        log.info("unloaded %s (%s)", name, reason)

    async def _unload_one(self, up: Upstream, name: str) -> None:
        try:
            async with self.session.post(f"{up.url}/v1/unload_lora_adapter", data=orjson.dumps({"lora_name": name}),
                                         headers={"Content-Type": "application/json"},
                                         timeout=aiohttp.ClientTimeout(total=30)) as r:
                if r.status != 200:
                    log.warning("unloading %s from %s: HTTP %d %s", name, up.url, r.status, await r.text())
        except Exception as exc:  # an upstream that is down has lost it anyway
            log.warning("unloading %s from %s failed: %s", name, up.url, exc)
