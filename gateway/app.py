"""The gateway's FastAPI app: routes, and the start/stop of what runs beside them.

The lifespan owns the pooled upstream client, the upstream health checks, the Kafka log producer and
the policy follower (hot-swap); ``create_app`` wires them and nothing else. With API keys configured,
``auth.AuthMiddleware`` checks every request before a route sees it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version

import aiohttp
import orjson
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from streamrl.broker.schema import JudgeRequest, RewardRecord
from streamrl.broker.topics import Topics

from .auth import ApiKey, AuthMiddleware, check_bind, has_scope, load_keys, request_key
from .config import GatewayConfig
from .coordination import Coordination, default_gateway_id
from .dashboard import Dashboard
from .dashboard_routes import add_dashboard_routes
from .hotswap import PolicyFollower
from .loop_lag import CollectionPauses, LoopLagMonitor
from .metrics import GatewayMetrics
from .openapi import openapi_document
from .policy import PolicyTable
from .proxy import JSON, BadRequest, Proxy, error_response, read_body
from .recording.capture import RECORD_BUILDERS
from .recording.capture_stream import deferred_captures
from .recording.delivery import FAILED, NCOUNTS, Delivery
from .recording.log_producer import LogProducer, ProducerStats, WaiterSpec
from .recording.recorder import Recorder
from .rewards import parse_trajectory_ends, post_rewards
from .tail_process import TailProcess
from .upstreams import UpstreamPool
from .wire import CHAT, COMPLETIONS

log = logging.getLogger(__name__)

PRODUCER_START_S = 30.0
"""How long a starting gateway waits for its record producer process to read the pipe before it serves: load
taken while that process still starts (a second of a CPU, importing) made a fresh gateway's first second slow."""


class Gateway:
    """The parts of one running gateway, reachable from tests as ``app.state.gateway``."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.started_at = time.time()
        self.gateway_id = config.gateway_id or default_gateway_id(self.started_at)
        """This process's id on the coordination topic (``/health`` says it, and who leads)."""
        self.keys = load_keys(config.api_keys, os.environ)
        check_bind(config.host, self.keys, config.insecure)
        for key_id, unknown in self.keys.unknown_policies(config.policy_names):
            log.warning("API key %s names policies this gateway does not serve: %s", key_id, ", ".join(unknown))
        self.topics = Topics(config.kafka.topic_prefix)
        self.metrics = GatewayMetrics()
        self.metrics.info.labels(self.gateway_id).set(1)
        self.pool = UpstreamPool(config.upstreams, interval_s=config.health_interval_s,
                                 timeout_s=config.health_timeout_s, eject_after=config.health_failures_to_eject,
                                 token_capture=config.token_capture, deferred_capture=config.deferred_capture,
                                 policies=len(config.policy_names), max_loaded_versions=config.max_loaded_versions,
                                 in_flight=config.update_mode == "in-flight")
        self.policies = PolicyTable(config.policy_names, self.pool, config.pinned_hold_s)
        self.router = self.policies.default
        """The default policy's (``policy_name``): ``/health``'s ``policy``, the dashboard's first."""
        self.producer: LogProducer | None = None
        self.reward_counts = [0] * NCOUNTS
        self.reward_delivery: Delivery | None = None
        """Rewards are delivered from this process, not the producer's: a ``POST /v1/rewards`` is answered
        once its rewards are durable (acknowledged by Kafka or fsynced in the spool)."""
        self.proxy = Proxy(config, self.pool, self.policies, self.metrics, auth_on=bool(self.keys))
        self.followers: dict[str, PolicyFollower] = {}
        """One per policy, by name (none with logging off)."""
        self.tails: list[TailProcess] = []
        """Per policy, one process that reads the policy and coordination topics and writes this gateway's state
        for that policy (a topic is tailed once per process)."""
        self.session: aiohttp.ClientSession | None = None
        self.fresh_session: aiohttp.ClientSession | None = None
        self.loop_lag = LoopLagMonitor(self.metrics.loop_lag.observe)
        self.gc_pauses = CollectionPauses()
        self.metrics.watch_collections(self.gc_pauses)
        self.metrics.watch(self.pool, lambda: self.producer.stats if self.producer else None,
                           lambda: self.producer.buffered if self.producer else 0,
                           lambda: {r.name: r.version for r in self.policies},
                           self.reward_stats)
        self.dashboard = Dashboard(self.policies, self.pool, self.metrics,
                                   lambda: self.producer.stats if self.producer else None,
                                   lambda: self.producer.buffered if self.producer else 0,
                                   interval_s=config.dashboard_interval_s) if config.dashboard else None

    async def start(self) -> None:
        c = self.config
        self.loop_lag.start()
        self.gc_pauses.install()
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=c.upstream_keepalive_s,
                                         ttl_dns_cache=None)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False,
                                             skip_auto_headers=("User-Agent",))
        # a retry after an upstream hung up goes out on a new connection: another pooled one may be
        # just as stale (a server under load closes idle connections late, as the next request arrives)
        self.fresh_session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                                   auto_decompress=False, skip_auto_headers=("User-Agent",))
        if c.kafka.bootstrap_servers is not None:
            waiter = None
            if c.token_capture and c.deferred_capture:  # the producer reads the engines' capture streams
                consumer = os.urandom(8).hex()
                waiter = WaiterSpec(deferred_captures,
                                    (consumer, dict(c.extra_headers), c.deferred_capture_wait_s))
                self.proxy.defer_to(consumer)
            self.producer = LogProducer(c.kafka.bootstrap_servers, max_buffered=c.max_buffered_records,
                                        max_buffered_bytes=c.max_buffered_bytes,
                                        send_timeout_ms=c.producer_send_timeout_ms, process=c.producer_process,
                                        spool_dir=c.spool_path, spool_max_bytes=c.spool_max_bytes,
                                        spool_after_ms=c.spool_after_ms, security=c.kafka, waiter=waiter,
                                        client=c.producer_client, builders=RECORD_BUILDERS)
            self.reward_delivery = self.producer.config.delivery(self.reward_counts, "rewards", linger_ms=0)
            self.proxy.recorder = Recorder(self.producer, self.topics.completions, self.metrics, self.dashboard)
        self.proxy.session = self.session
        self.proxy.fresh_session = self.fresh_session
        await self.pool.start(self.session)
        if self.dashboard is not None:
            self.dashboard.start()
        if c.kafka.bootstrap_servers is not None and c.follow_policy:
            for router in self.policies:
                tails = TailProcess(c.kafka.bootstrap_servers, security=c.kafka,
                                    client_id=f"streamrl-gateway-{self.gateway_id}")
                self.tails.append(tails)
                await tails.start()
                coordination = Coordination(c, self.topics, tails, self.gateway_id, router.name)
                self.followers[router.name] = PolicyFollower(
                    c, self.pool, router, self.session, self.topics.policy, self.metrics, coordination,
                    self.dashboard.board(router.name) if self.dashboard is not None else None)
            await asyncio.gather(*(f.start(c.policy_catch_up_s) for f in self.followers.values()))
        if self.producer is not None and not await asyncio.to_thread(self.producer.wait_ready, PRODUCER_START_S):
            log.warning("the record producer process has not started after %.0fs; serving on (records wait in "
                        "the pipe)", PRODUCER_START_S)
        log.info("gateway %s up: upstreams %s, logging %s, policy name %r, %s", self.gateway_id,
                 list(c.upstreams), "to " + c.kafka.bootstrap_servers if c.kafka.bootstrap_servers else "off", c.policy_name,
                 f"API keys {', '.join(self.keys.ids)}" if self.keys else "no API keys")

    async def stop(self) -> None:
        try:
            self.loop_lag.stop()
            self.gc_pauses.uninstall()
            if self.dashboard is not None:
                await self.dashboard.stop()
            await asyncio.gather(*(f.stop() for f in self.followers.values()))
            await asyncio.gather(*(t.stop() for t in self.tails))
            await self.pool.stop()
            await self.proxy.finish_late_captures(min(self.config.upstream_timeout_s, 10.0))
            for session in (self.session, self.fresh_session):
                if session is not None:
                    await session.close()
        finally:  # whatever failed above, what was logged is delivered (or spooled) and the producers stop
            if self.producer is not None:
                self.producer.close()
            if self.reward_delivery is not None:
                self.reward_delivery.close(self.config.producer_send_timeout_ms / 1000)

    def health(self, detail: bool = True, policy: bool = True) -> dict[str, object]:
        """The full state with ``detail`` (admin); else the status, and with ``policy`` the routed version
        (which any inference caller learns from ``X-Policy-Version`` anyway)."""
        healthy = sum(u.healthy for u in self.pool.upstreams)
        stats = self.producer.stats if self.producer else None
        rewards = self.reward_stats()
        spool_full = any(s is not None and s.spool_full for s in (stats, rewards))
        status = "no_healthy_upstream" if not healthy else "spool_full" if spool_full else "ok"
        if not detail:
            return {"status": status, "policy": {"name": self.router.name, "version": self.router.version}} \
                if policy else {"status": status}
        return {
            "status": status,
            "gateway": {"gateway_id": self.gateway_id, "pid": os.getpid()} if not self.followers
            else {**self.followers[self.router.name].coordination.view(), "pid": os.getpid()},
            "upstreams": [u.state() for u in self.pool.upstreams],
            "policy": self.router.state(),
            "policies": {r.name: r.state() for r in self.policies},
            "producer": None if stats is None else {
                "offered": stats.offered, "delivered": stats.delivered, "failed": stats.failed,
                "dropped": stats.dropped, "invalid": stats.invalid, "buffered": self.producer.buffered,
                "waited": stats.waited, "pipe_bytes": self.producer.pipe_bytes,
            },
            "spool": None if stats is None or rewards is None else {
                "dir": str(self.config.spool_path), "full": spool_full,
                "completions": spool_state(stats), "rewards": spool_state(rewards),
            },
        }

    @property
    def follower(self) -> PolicyFollower | None:
        """The default policy's follower (None with logging or following off)."""
        return self.followers.get(self.router.name)

    def reward_stats(self) -> ProducerStats | None:
        if self.reward_delivery is None:
            return None
        c = self.reward_counts
        return ProducerStats.from_counts(c, failed=c[FAILED])

    def rewards_accepted(self, records: list[RewardRecord | JudgeRequest]) -> None:
        """Rewards (and judge requests) durable: counted by the policy they name; their episodes ended (what
        these pinned is let go); rewards go to the dashboard's per-version rewards of the policy whose call they
        reward."""
        for r in records:
            self.metrics.rewards.labels(r.policy or "").inc()
        self.policies.end_episodes({r.trajectory_id for r in records})
        if self.dashboard is not None:
            self.dashboard.rewarded([r for r in records if isinstance(r, RewardRecord)])

    def models(self, key: ApiKey | None = None) -> dict[str, object]:
        """The upstreams' models and each policy; a key limited to policies sees only its policies."""
        cards = self.pool.model_cards()
        base = cards[0]["id"] if cards else None
        if key is not None and not key.may_use(None):
            cards = []
        if base is not None:
            cards += [{"id": r.name, "object": "model", "owned_by": "streamrl",
                       "root": r.routed.served_name if r.routed else base, "parent": base}
                      for r in self.policies if key is None or key.may_use(r.name)]
        return {"object": "list", "data": cards}


def spool_state(s: ProducerStats) -> dict[str, object]:
    return {"spooling": s.spooling, "records": s.spool_records, "bytes": s.spool_bytes, "full": s.spool_full, "spooled": s.spooled,
            "replayed": s.replayed, "dropped": s.spool_dropped, "corrupt": s.spool_corrupt}


def tune_runtime() -> None:
    """Keep the garbage collector and the GIL from stalling the event loop.

    Parsing a 1,000-token body allocates thousands of objects; with default thresholds that triggers
    collections that walk the whole long-lived heap (FastAPI, pydantic, kafka-python), and background
    threads (record encoding, the Kafka client) hold the GIL for up to the 5 ms switch interval.
    Freezing what exists after start-up, collecting young objects less often and switching threads
    sooner keeps the added latency to a fraction of a millisecond.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 100)
    sys.setswitchinterval(0.0005)


def create_app(config: GatewayConfig) -> FastAPI:
    gateway = Gateway(config)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        tune_runtime()
        try:
            yield
        finally:
            await gateway.stop()

    app = FastAPI(title="streamrl gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.gateway = gateway
    proxy = gateway.proxy

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy.handle(request, CHAT)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.handle(request, COMPLETIONS)

    @app.post("/v1/rewards")
    async def rewards(request: Request) -> Response:
        started = time.perf_counter()
        key = request_key(request.scope)
        response = await post_rewards(request, gateway.reward_delivery, gateway.topics.rewards, config.max_body_bytes,
                                      (config.spool_after_ms + config.producer_send_timeout_ms) / 1000,
                                      key, config.policy_names, gateway.rewards_accepted)
        gateway.metrics.observe("/v1/rewards", response.status_code, time.perf_counter() - started)
        return response

    @app.post("/v1/trajectories/end")
    async def end_trajectories(request: Request) -> Response:
        """Episodes that post no reward (an evaluation's) say they ended: the versions they pinned are let go."""
        started = time.perf_counter()
        try:
            ids = parse_trajectory_ends(await read_body(request, config.max_body_bytes))
        except BadRequest as exc:
            response = error_response(exc.status, exc.message, exc.param)
        else:
            response = Response(orjson.dumps({"ended": gateway.policies.end_episodes(ids)}), media_type=JSON)
        gateway.metrics.observe("/v1/trajectories/end", response.status_code, time.perf_counter() - started)
        return response

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return Response(orjson.dumps(gateway.models(request_key(request.scope))), media_type=JSON)

    auth_on = bool(gateway.keys)

    @app.get("/health")
    async def health(request: Request) -> Response:
        """Open to load balancers; the detail needs ``admin`` when keys are checked."""
        detail = has_scope(request.scope, "admin", auth_on)
        return Response(orjson.dumps(gateway.health(detail, policy=request_key(request.scope) is not None)),
                        media_type=JSON)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(gateway.metrics.render(), media_type="text/plain; version=0.0.4")

    openapi_json = orjson.dumps(openapi_document(app.title, _streamrl_version()))

    @app.get("/openapi.json")
    async def openapi() -> Response:
        return Response(openapi_json, media_type=JSON)

    if gateway.dashboard is not None:
        add_dashboard_routes(app, gateway.dashboard)
    if gateway.keys:
        app.add_middleware(AuthMiddleware, keys=gateway.keys)
    return app


def _streamrl_version() -> str:
    """The installed version; a source tree run without installing (the GPU machines' layout) has none."""
    try:
        return package_version("streamrl")
    except PackageNotFoundError:
        return "0+source"
