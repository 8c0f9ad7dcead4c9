"""Several gateways in front of one real vLLM server, coordinated through the gateways topic: under client
load through all of them, published versions are loaded into the engine once each (counted in the
engine's own log), every gateway routes the newest, no request fails and no record is lost; a gateway
started late catches up; a leader killed with SIGKILL in the middle of a load leaves nothing that blocks
the others, which finish the swap. One trajectory whose calls alternate between gateways is recorded
whole."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from support.kafka_reader import TopicReader
from support.relay import Relay
from support.swap_helpers import engine_adapters, engine_loads, wait_unloaded

from streamrl.broker.embedded import EmbeddedBroker, free_port
from streamrl.broker.policy_log import publish_version
from streamrl.broker.schema import CompletionRecord
from streamrl.broker.topics import Topics
from streamrl.child import spawn, stop_group, wait_http
from streamrl.engine.server import Engine
from streamrl.gateway.config import GatewayConfig, GatewayKafka
from streamrl.gateway.server import GatewayServer

ADAPTER_VERSIONS = 3
TOPICS = Topics("gateways")
CHAT = [{"role": "user", "content": "Count to ten."}]
LOG_DIR = Path(os.environ.get("STREAMRL_TEST_LOGS", "/tmp/streamrl-test-logs"))


@pytest.fixture
def name(engine: Engine, caplog: pytest.LogCaptureFixture) -> Iterator[str]:
    """A policy name of this test alone (the engine's log is appended to across runs); its adapters are
    unloaded afterwards. The gateways' swap logs are kept for a failure to show."""
    caplog.set_level(logging.INFO, logger="streamrl.gateway.hotswap")
    policy = f"multi{uuid.uuid4().hex[:8]}"
    yield policy
    for adapter in engine_adapters(engine):
        if adapter.startswith(f"{policy}@"):
            httpx.post(f"{engine.url}/v1/unload_lora_adapter", json={"lora_name": adapter})


def gateway_config(broker: EmbeddedBroker, upstream: str, name: str, tmp: Path, **kw) -> GatewayConfig:
    """Beats of 0.2 s and a TTL of 2 s: a dead gateway is found out within the test's patience."""
    port = free_port()
    return GatewayConfig(upstreams=(upstream,),
                         kafka=GatewayKafka(bootstrap_servers=broker.bootstrap_servers, topic_prefix=TOPICS.prefix),
                         port=port, policy_name=name, health_interval_s=0.5, heartbeat_s=0.2,
                         gateway_ttl_s=2.0, spool_dir=str(tmp / f"spool-{port}"), **kw)


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
        time.sleep(0.02)


def load_calls(url: str) -> dict[str, float]:
    """The adapter loads a gateway asked of its upstreams, by answer (its /metrics)."""
    lines = httpx.get(f"{url}/metrics").text.splitlines()
    return {answer: sum(float(line.split()[-1]) for line in lines
                        if line.startswith(f'streamrl_gateway_adapter_loads_total{{answer="{answer}"}}'))
            for answer in ("loaded", "already")}


def routed(url: str) -> int:
    return httpx.get(f"{url}/health", timeout=10).json()["policy"]["version"]


class Load:
    """Client threads sending chat calls round-robin through the gateways until stopped; every answer's
    status, version header and request id is kept."""

    def __init__(self, urls: list[str], name: str, threads: int = 4) -> None:
        self.urls, self.name = urls, name
        self.results: list[tuple[str, str, str]] = []  # (gateway url, version header, request id)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._work, args=(i,), daemon=True) for i in range(threads)]

    def _work(self, i: int) -> None:
        with httpx.Client(timeout=120) as http:
            n = i
            while not self._stop.is_set():
                url = self.urls[n % len(self.urls)]
                n += 1
                body = {"model": self.name, "messages": CHAT, "max_tokens": 4, "stream": n % 2 == 0}
                try:
                    r = http.post(f"{url}/v1/chat/completions", json=body)
                    if r.status_code != 200 or "error" in r.text[:200]:
                        self.errors.append(f"{url} {r.status_code}: {r.text[:200]}")
                        continue
                    self.results.append((url, r.headers["x-policy-version"], r.headers["x-request-id"]))
                except httpx.HTTPError as exc:
                    self.errors.append(f"{url} {exc!r}")

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()

    def served_by(self, version: int, at_least: int = 2, timeout: float = 60.0) -> None:
        """Wait until each gateway has served ``at_least`` requests on ``version``."""
        def done() -> bool:
            assert not self.errors, self.errors[:3]
            return all(sum(u == url and v == str(version) for u, v, _ in list(self.results)) >= at_least
                       for url in self.urls)
        wait_until(done, f"every gateway serving v{version}", timeout)


def invalid_calls(urls: list[str]) -> int:
    """Calls answered 200 whose record the gateways could not build, counted (``producer.invalid``)."""
    return sum(httpx.get(f"{u}/health").json()["producer"]["invalid"] for u in urls)


def records_of(reader: TopicReader, request_ids: set[str], urls: list[str]) -> list[CompletionRecord]:
    """Every completion record of these requests, waited for, none twice, and none counted invalid. (A call
    the engine sends no capture for is counted invalid by its gateway: 1-3% of the calls made here under
    load did so before the engine's capture stopped holding vLLM's token lists by reference,
    docs/benchmarks.md "What the soak found"; the wait below still accounts for them, so that a regression
    fails on the count, not on a timeout.)"""
    def mine(r: object) -> bool:
        return isinstance(r, CompletionRecord) and r.request_id in request_ids
    deadline = time.monotonic() + 60
    while True:
        invalid = invalid_calls(urls)
        try:
            recs = reader.wait_for(mine, count=len(request_ids) - invalid, timeout=2)
            break
        except AssertionError:
            assert time.monotonic() < deadline, f"records of {len(request_ids)} calls: {invalid} counted invalid, " \
                                                f"{sum(mine(r) for r in reader.seen)} arrived"
    ids = [r.request_id for r in recs]
    assert len(ids) == len(set(ids)) and len(ids) + invalid_calls(urls) == len(request_ids), (len(ids), invalid)
    assert invalid_calls(urls) == 0, "calls answered 200 without a record"
    return recs


def start_all(configs: list[GatewayConfig]) -> list[GatewayServer]:
    """A gateway of each config, started; if one does not start, those started are stopped (none left over)."""
    started: list[GatewayServer] = []
    try:
        for config in configs:
            started.append(GatewayServer(config).start())
    except BaseException:
        for gw in started:
            gw.stop()
        raise
    return started


def test_gateways_share_swaps_under_load(broker, engine, topics, adapters, base_model, name, tmp_path):
    """Three gateways, a leader and two followers: every check runs across followers too (none asks for a load,
    each routes every version, the late one joins them). A leader with a single follower is what
    ``test_unload_waits_for_a_follower_until_it_dies`` and ``test_workers_share_one_port`` run."""
    n = 3
    reader = TopicReader(broker.bootstrap_servers, topics.completions)
    gateways = start_all([gateway_config(broker, engine.url, name, tmp_path) for _ in range(n)])
    try:
        urls = [gw.url for gw in gateways]
        views = [httpx.get(f"{u}/health").json()["gateway"] for u in urls]
        first = gateways[0].gateway.gateway_id
        assert len({v["gateway_id"] for v in views}) == n and {v["leader"] for v in views} == {first}
        wait_until(lambda: all(len(httpx.get(f"{u}/health").json()["gateway"]["live"]) == n for u in urls),
                   "every gateway sees every other")
        with Load(urls, name) as load:
            for version, path in enumerate(adapters, start=1):
                publish_version(broker.bootstrap_servers, topics, name, version, path, base_model)
                load.served_by(version)
        assert not load.errors, load.errors[:5]
        assert all(routed(u) == 3 for u in urls)
        # each version went into the engine once, though n gateways followed the policy topic
        assert [engine_loads(engine, f"{name}@v{v}") for v in (1, 2, 3)] == [1, 1, 1]
        calls = [load_calls(u) for u in urls]  # asked by the leader alone, once each
        assert calls[0] == {"loaded": 3, "already": 0} and all(c == {"loaded": 0, "already": 0} for c in calls[1:])
        # v1, older than the one kept before the routed version, is unloaded once every gateway let it go
        wait_unloaded(engine, f"{name}@v1")
        assert {f"{name}@v2", f"{name}@v3"} <= engine_adapters(engine)
        for u in urls:  # on every gateway: v1 is gone, the kept v2 still serves pinned requests
            r = httpx.post(f"{u}/v1/completions", json={"model": f"{name}@v1", "prompt": "a", "max_tokens": 2})
            assert r.status_code == 404
            r = httpx.post(f"{u}/v1/completions", json={"model": f"{name}@v2", "prompt": "a", "max_tokens": 2})
            assert r.status_code == 200 and r.headers["x-policy-version"] == "2"
        # no record lost: every answered request has its record, once, with the version that served it
        served = {rid: int(v) for _, v, rid in load.results}
        recs = records_of(reader, set(served), urls)
        assert all(r.policy_version == served[r.request_id] for r in recs)

        # a gateway started late routes the newest version before it serves, and loads nothing
        with GatewayServer(gateway_config(broker, engine.url, name, tmp_path)) as late:
            assert late.gateway.router.version == 3
            assert httpx.get(f"{late.url}/health").json()["gateway"]["leader"] == first
            r = httpx.post(f"{late.url}/v1/chat/completions", json={"model": name, "messages": CHAT, "max_tokens": 2})
            assert r.status_code == 200 and r.headers["x-policy-version"] == "3"
        assert engine_loads(engine, f"{name}@v3") == 1
    finally:
        for gw in gateways:
            gw.stop()
        reader.close()


def test_leader_killed_during_a_load(broker, engine, topics, adapters, base_model, name, tmp_path, relay: Relay):
    """The leader is a ``streamrl gateway`` process; its load of v2 reaches the engine through a relay that
    holds the answer back, so the leader is mid-load however fast the engine is. SIGKILL to it then; the
    two other gateways keep serving v1, the next-oldest takes over after the TTL, finishes the swap
    (the engine already has v2: "already loaded" counts as loaded) and both route v2."""
    reader = TopicReader(broker.bootstrap_servers, topics.completions)
    config = gateway_config(broker, relay.url, name, tmp_path)
    config_file = tmp_path / "leader.json"
    config_file.write_text(json.dumps(dataclasses.asdict(config)))
    cmd = [str(Path(sys.executable).with_name("streamrl")), "gateway", "--config", str(config_file)]
    leader = spawn(cmd, log=LOG_DIR / "gateways-leader.log")
    followers: list[GatewayServer] = []
    try:
        wait_http(f"http://127.0.0.1:{config.port}", 120, leader, what="gateway")
        publish_version(broker.bootstrap_servers, topics, name, 1, adapters[0], base_model)
        wait_until(lambda: routed(f"http://127.0.0.1:{config.port}") == 1, "the leader routes v1")
        followers = start_all([gateway_config(broker, relay.url, name, tmp_path) for _ in range(2)])
        leader_id = httpx.get(f"http://127.0.0.1:{config.port}/health").json()["gateway"]["gateway_id"]
        assert all(f.gateway.follower.coordination.leader() == leader_id for f in followers)
        assert all(f.gateway.router.version == 1 for f in followers)
        urls = [f.url for f in followers]
        with Load(urls, name) as load:
            load.served_by(1)
            relay.hold_marker = str(adapters[1].resolve()).encode()  # the load request names its path
            publish_version(broker.bootstrap_servers, topics, name, 2, adapters[1], base_model)
            assert relay.holding.wait(60), "the leader did not ask the engine to load v2"
            wait_until(lambda: f"{name}@v2" in engine_adapters(engine), "the engine loaded v2")
            assert all(f.gateway.router.version == 1 for f in followers)  # not loaded as far as the leader said
            os.killpg(leader.pid, signal.SIGKILL)
            leader.wait()
            relay.release()
            load.served_by(2, timeout=60)  # the next-oldest took over and finished the swap
        assert not load.errors, load.errors[:5]
        assert followers[0].gateway.follower.leading and not followers[1].gateway.follower.leading
        assert all(f.gateway.router.version == 2 for f in followers)
        assert [engine_loads(engine, f"{name}@v{v}") for v in (1, 2)] == [1, 1]
        # the new leader found v2 loaded by the dead one: one "already", no load of its own
        assert [load_calls(u) for u in urls] == [{"loaded": 0, "already": 1}, {"loaded": 0, "already": 0}]
        versions = {v for _, v, _ in load.results}
        assert versions == {"1", "2"}
        served = {rid: int(v) for _, v, rid in load.results}
        recs = records_of(reader, set(served), urls)
        assert all(r.policy_version == served[r.request_id] for r in recs)
    finally:
        relay.release()
        stop_group(leader, 30)
        for f in followers:
            f.stop()
        reader.close()


def test_unload_waits_for_a_follower_until_it_dies(broker, engine, topics, adapters, base_model, name, tmp_path,
                                                  relay: Relay):
    """A follower (a ``streamrl gateway`` process) holds a pinned request on v1 in flight: its answer is held
    by a relay. v2 and v3 are published, so the leader retires v1, and waits: the follower's states, which
    have read the retiring record, still use v1, and the engine keeps it. SIGKILL to the follower: once its
    states stop coming (the TTL) the leader no longer waits for it and unloads v1, and goes on serving v3."""
    with GatewayServer(gateway_config(broker, relay.url, name, tmp_path)) as leader:  # the same replica URL
        config = gateway_config(broker, relay.url, name, tmp_path)
        config_file = tmp_path / "follower.json"
        config_file.write_text(json.dumps(dataclasses.asdict(config)))
        cmd = [str(Path(sys.executable).with_name("streamrl")), "gateway", "--config", str(config_file)]
        follower = spawn(cmd, log=LOG_DIR / "gateways-follower.log")
        follower_url = f"http://127.0.0.1:{config.port}"
        held: list[object] = []
        try:
            wait_http(follower_url, 120, follower, what="gateway")
            follower_id = httpx.get(f"{follower_url}/health").json()["gateway"]["gateway_id"]
            publish_version(broker.bootstrap_servers, topics, name, 1, adapters[0], base_model)
            wait_until(lambda: routed(follower_url) == 1, "the follower routes v1")
            marker = f"held-{uuid.uuid4().hex[:8]}"
            relay.hold_marker = marker.encode()

            def pinned() -> None:
                try:
                    held.append(httpx.post(f"{follower_url}/v1/completions", timeout=120, json={
                        "model": f"{name}@v1", "prompt": marker, "max_tokens": 2}).status_code)
                except httpx.HTTPError as exc:  # the follower is killed under it
                    held.append(exc)

            thread = threading.Thread(target=pinned, daemon=True)
            thread.start()
            assert relay.holding.wait(60), "the pinned request did not reach the engine"
            for version, path in ((2, adapters[1]), (3, adapters[2])):  # each routed (none skipped as superseded)
                publish_version(broker.bootstrap_servers, topics, name, version, path, base_model)
                wait_until(lambda v=version: leader.gateway.router.version == v, f"the leader routes v{version}")
            plan, swap = leader.gateway.follower.plan, leader.gateway.follower
            wait_until(lambda: plan.retiring.get(1) is not None and plan.retiring[1] >= 0,
                       f"the leader retires v1 (retiring {plan.retiring}, loaded {sorted(plan.loaded)})", timeout=20)

            def follower_still_uses_v1() -> bool:
                seen = swap.coordination.seen.get(follower_id)
                return seen is not None and seen.state.seen_offset >= plan.retiring[1] and 1 in seen.state.in_use

            wait_until(follower_still_uses_v1, "the follower's state after the retiring record still uses v1")
            assert f"{name}@v1" in engine_adapters(engine), "v1 unloaded under the follower's request"
            os.killpg(follower.pid, signal.SIGKILL)
            follower.wait()
            killed = time.monotonic()
            wait_unloaded(engine, f"{name}@v1")
            assert time.monotonic() - killed < 30
            assert engine_loads(engine, f"{name}@v1") == 1
            r = httpx.post(f"{leader.url}/v1/chat/completions", timeout=60,
                           json={"model": name, "messages": CHAT, "max_tokens": 2})
            assert r.status_code == 200 and r.headers["x-policy-version"] == "3"
        finally:
            relay.release()
            stop_group(follower, 30)
        thread.join(30)
        assert held and not isinstance(held[0], int), "the held request cannot have been answered"


def test_trajectory_alternating_between_gateways_is_recorded_whole(broker, engine, base_model, tmp_path):
    """One agent's calls, each turn through the other gateway (a load balancer's choice): every call's
    record arrives, once, under the one trajectory id, and the records of both gateways carry the same
    fields (nothing says which gateway wrote them)."""
    reader = TopicReader(broker.bootstrap_servers, broker.topics.completions)
    configs = [dataclasses.replace(gateway_config(broker, engine.url, "policy", tmp_path), follow_policy=False,
                                   kafka=GatewayKafka(bootstrap_servers=broker.bootstrap_servers,
                                                      topic_prefix=broker.topics.prefix)) for _ in range(2)]
    gateways = start_all(configs)
    try:
        trajectory = f"traj-{uuid.uuid4().hex}"
        messages = [{"role": "user", "content": "Start counting."}]
        ids: list[str] = []
        for turn in range(6):
            gw = gateways[turn % 2]
            r = httpx.post(f"{gw.url}/v1/chat/completions", headers={"X-Trajectory-Id": trajectory},
                           json={"model": base_model, "messages": messages, "max_tokens": 4}, timeout=120)
            assert r.status_code == 200
            ids.append(r.headers["x-request-id"])
            messages += [r.json()["choices"][0]["message"], {"role": "user", "content": f"Go on ({turn})."}]
        recs = records_of(reader, set(ids), [gw.url for gw in gateways])
        assert len(recs) == len(ids)
        assert {r.trajectory_id for r in recs} == {trajectory}
        by_id = {r.request_id: r for r in recs}
        prompts = [by_id[i].prompt_token_ids.size for i in ids]
        assert prompts == sorted(prompts) and len(set(prompts)) == 6  # each turn's prompt holds the last one's
        fields = [{f.name for f in dataclasses.fields(r) if getattr(r, f.name) is not None} for r in recs]
        assert all(f == fields[0] for f in fields)
        assert {r.upstream for r in recs} == {engine.url}
    finally:
        for gw in gateways:
            gw.stop()
        reader.close()


def test_workers_share_one_port(broker, engine, topics, adapters, base_model, name, tmp_path):
    """``streamrl gateway --workers 2``: two gateway processes on one port (``SO_REUSEPORT``), each with its
    own id and spool directory, one leader between them; a published version is loaded once and both
    route it; a worker killed with SIGKILL is started again by the parent and catches up."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    spool = tmp_path / "spool"
    cmd = [str(Path(sys.executable).with_name("streamrl")), "gateway", "--workers", "2", "--upstream", engine.url,
           "--bootstrap-servers", broker.bootstrap_servers, "--port", str(port), "--topic-prefix", TOPICS.prefix,
           "--policy-name", name, "--spool-dir", str(spool), "--heartbeat-s", "0.2", "--gateway-ttl-s", "2"]
    proc = spawn(cmd, log=LOG_DIR / "gateway-workers.log")

    def workers(version: int, exclude: frozenset[int] = frozenset()) -> dict[int, dict]:
        """The /health of each worker (by pid) routing ``version``, asked on new connections until two
        answered (the kernel picks a worker per connection)."""
        seen: dict[int, dict] = {}
        deadline = time.monotonic() + 120
        while len(seen) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, f"workers seen: {list(seen)}"
            try:
                health = httpx.get(f"{url}/health", timeout=10).json()
            except httpx.HTTPError:
                continue
            pid = health["gateway"]["pid"]
            if pid not in exclude and health["policy"]["version"] == version and len(health["gateway"]["live"]) == 2:
                seen[pid] = health
        return seen

    try:
        wait_http(url, 120, proc, what="gateway workers")
        first = workers(0)
        assert len({h["gateway"]["gateway_id"] for h in first.values()}) == 2
        assert len({h["gateway"]["leader"] for h in first.values()}) == 1  # one leader, the same for both
        assert {h["spool"]["dir"] for h in first.values()} == {str(spool / "worker-0"), str(spool / "worker-1")}
        publish_version(broker.bootstrap_servers, topics, name, 1, adapters[0], base_model)
        routing = workers(1)
        assert engine_loads(engine, f"{name}@v1") == 1
        victim = min(routing)
        os.kill(victim, signal.SIGKILL)
        again = workers(1, exclude=frozenset({victim}))  # the parent started a new one; it routes v1 at once
        assert victim not in again and len(again) == 2
        for _ in range(6):
            r = httpx.post(f"{url}/v1/chat/completions", json={"model": name, "messages": CHAT, "max_tokens": 2},
                           timeout=120)
            assert r.status_code == 200 and r.headers["x-policy-version"] == "1"
        assert engine_loads(engine, f"{name}@v1") == 1
    finally:
        stop_group(proc, 30)


CATCH_UP_S = 0.5
"""The catch-up wait of the gateway started with Kafka down: any wait runs out the same way (the coordination
and policy topics unread, the gateway serves on), so it is kept short. kafka-python's reconnect backoff grows with
each refused attempt (x4 a try); streamrl's clients cap it at 1 s (``broker/clients.py``), so the gateway is back
within about a second of the broker's start (with kafka-python's own cap, 30 s, a 2 s wait here once had its next
try come 7.5 s after the broker was up)."""


def test_a_gateway_started_with_kafka_down_serves_then_joins(engine, adapters, base_model, name, tmp_path):
    """Kafka unreachable at start: the gateway serves (the base model, records to its spool) after its
    catch-up wait instead of failing to start, and joins the coordination, leads and follows the policy
    topic once the broker is up."""
    own = EmbeddedBroker(topics=Topics("gateways-late"), partitions=2, log_file=LOG_DIR / "broker-gateways.log")
    config = dataclasses.replace(gateway_config(own, engine.url, name, tmp_path), policy_catch_up_s=CATCH_UP_S,
                                 kafka=GatewayKafka(bootstrap_servers=own.bootstrap_servers, topic_prefix=own.topics.prefix))
    try:
        with GatewayServer(config) as gw:
            r = httpx.post(f"{gw.url}/v1/chat/completions", json={"model": name, "messages": CHAT, "max_tokens": 2},
                           timeout=120)
            assert r.status_code == 200 and r.headers["x-policy-version"] == "0"
            assert not gw.gateway.follower.coordination.ready and not gw.gateway.follower.leading
            own.start()
            wait_until(lambda: gw.gateway.follower.leading, "the gateway joined and leads")
            assert httpx.get(f"{gw.url}/health").json()["gateway"]["live"] == [gw.gateway.gateway_id]
            publish_version(own.bootstrap_servers, own.topics, name, 1, adapters[0], base_model)
            wait_until(lambda: gw.gateway.router.version == 1, "v1 routed")
    finally:
        own.stop()
