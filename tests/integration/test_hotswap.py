"""Hot-swap under load, against a real vLLM server: published adapter versions replace each other in the
gateway with no failed request, every response names a published version, and requests that started
before a swap finish on the version they started with."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from support.kafka_reader import TopicReader
from support.relay import Relay
from support.swap_helpers import engine_adapters, engine_loads, wait_unloaded

from streamrl.broker.clients import make_producer
from streamrl.broker.embedded import EmbeddedBroker, free_port
from streamrl.broker.policy_log import publish_version
from streamrl.broker.schema import CompletionRecord, PolicyRecord, encode, token_versions
from streamrl.broker.topics import Topics
from streamrl.engine.server import Engine
from streamrl.gateway import hotswap
from streamrl.gateway.config import GatewayConfig, GatewayKafka
from streamrl.gateway.server import GatewayServer

TOPICS = Topics("hotswap")
CHAT = [{"role": "user", "content": "Count to ten."}]
PINNED_HOLD_S = 2.0
"""The hold of ``test_a_pinned_episode_keeps_its_retired_version_until_it_ends``: its moves follow each other within
milliseconds (one client, no work between them), so 2 s still leaves them a wide margin, and the test waits out one
hold at its end (the gateway's 5 s default made that wait 5 s)."""


@pytest.fixture(autouse=True)
def unload_afterwards(engine: Engine, caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Leave the shared engine without this module's adapters (their files go when pytest cleans up).
    The gateway's swap log (loads, routes, unloads and why) is kept, so that a failure shows it."""
    caplog.set_level(logging.INFO, logger="streamrl.gateway.hotswap")
    yield
    for card in httpx.get(f"{engine.url}/v1/models").json()["data"]:
        if card.get("parent") and card["id"].split("@")[0].startswith(("loadtest", "loadmove", "inflight", "catchup",
                                                                         "roommove", "pinhold", "settle")):
            httpx.post(f"{engine.url}/v1/unload_lora_adapter", json={"lora_name": card["id"]})


def gateway_config(broker: EmbeddedBroker, engine: Engine, name: str, **kw) -> GatewayConfig:
    kw.setdefault("upstreams", (engine.url,))
    return GatewayConfig(kafka=GatewayKafka(bootstrap_servers=broker.bootstrap_servers, topic_prefix=TOPICS.prefix),
                         port=free_port(), policy_name=name, health_interval_s=0.5, **kw)


def wait_routed(gw: GatewayServer, version: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while gw.gateway.router.version != version:
        assert time.monotonic() < deadline, f"version {version} not routed"
        time.sleep(0.01)


def wait_retired(gw: GatewayServer, version: int, timeout: float = 30.0) -> None:
    """Until the leader has retired ``version`` (a newer one routed)."""
    deadline = time.monotonic() + timeout
    while version not in gw.gateway.follower.plan.retiring:
        assert time.monotonic() < deadline, f"v{version} was not retired once a newer version was routed"
        time.sleep(0.01)


@pytest.mark.parametrize("update_mode", ["pinned", "in-flight"])
def test_swap_under_concurrent_load(broker, engine, topics, adapters, base_model, update_mode):
    """Also with requests moving to each new version while they run (``in-flight``): nothing fails either, and
    the records keep the routed version (any move is in their spans)."""
    name = "loadtest" if update_mode == "pinned" else "loadmove"
    published = {0}
    results: list[tuple[int, str, str, str]] = []  # (status, version header, served model, request id)
    errors: list[str] = []
    stop = threading.Event()
    reader = TopicReader(broker.bootstrap_servers, topics.completions)

    def worker(stream: bool) -> None:
        with httpx.Client(timeout=60) as http:
            while not stop.is_set():
                body = {"model": name, "messages": CHAT, "max_tokens": 8, "stream": stream}
                try:
                    with http.stream("POST", f"{gw.url}/v1/chat/completions", json=body) as r:
                        text = r.read().decode()
                        if r.status_code != 200 or "error" in text:
                            errors.append(f"{r.status_code}: {text[:200]}")
                            continue
                        served = text.split('"model":"', 1)[1].split('"', 1)[0]
                        results.append((r.status_code, r.headers["x-policy-version"], served,
                                        r.headers["x-request-id"]))
                except httpx.HTTPError as exc:
                    errors.append(repr(exc))

    with GatewayServer(gateway_config(broker, engine, name, update_mode=update_mode)) as gw:
        threads = [threading.Thread(target=worker, args=(i % 2 == 0,), daemon=True) for i in range(4)]
        for t in threads:
            t.start()

        def served_by(version: int) -> None:
            """Keep the load on until three requests were served by ``version`` (a count, not a duration: a
            fast swap leaves fewer requests in between than a slow one)."""
            deadline = time.monotonic() + 30
            while sum(v == str(version) for _, v, _, _ in list(results)) < 3:
                assert time.monotonic() < deadline and not errors, errors[:3]
                time.sleep(0.01)

        try:
            served_by(0)  # the base model, before any version
            for version, path in enumerate(adapters[:3], start=1):
                publish_version(broker.bootstrap_servers, topics, name, version, path, base_model)
                published.add(version)
                wait_routed(gw, version)
                served_by(version)  # across the swap
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert not errors, errors[:5]
        versions = {int(v) for _, v, _, _ in results}
        assert versions == published == {0, 1, 2, 3}
        for _, v, served, _ in results:  # the engine-side model is the adapter of the version in the header
            assert served == (base_model if v == "0" else f"{name}@v{v}")
        # the records carry the version that served them
        sample = {rid: int(v) for _, v, _, rid in results[-12:]}
        recs = reader.wait_for(lambda r: isinstance(r, CompletionRecord) and r.request_id in sample, count=12)
        assert {r.request_id: r.policy_version for r in recs} == sample
        assert all(r.policy_name == name for r in recs)
        for r in recs:  # a moved request's tokens come from its routed version or newer ones, in order
            versions = token_versions(r)
            assert (versions >= r.policy_version).all() and (np.diff(versions) >= 0).all()
        # versions no longer routed were unloaded once idle, but for the one before the routed version
        # (keep_previous_versions 1), which still serves requests pinned to it
        wait_unloaded(engine, f"{name}@v1")
        assert {f"{name}@v2", f"{name}@v3"} <= set(engine_adapters(engine))
        pinned = httpx.post(f"{gw.url}/v1/completions", json={"model": f"{name}@v2", "prompt": "a", "max_tokens": 2},
                            timeout=120)
        assert pinned.status_code == 200 and pinned.headers["x-policy-version"] == "2"
        gone = httpx.post(f"{gw.url}/v1/completions", json={"model": f"{name}@v1", "prompt": "a", "max_tokens": 2},
                          timeout=120)
        assert gone.status_code == 404
    reader.close()


def held_stream(url: str, name: str, prompt: str, out: dict[str, object]) -> threading.Thread:
    """A streamed completion of ``name`` in a thread (a relay holding ``prompt`` keeps it in flight); its
    version header and lines land in ``out``."""
    def run() -> None:
        body = {"model": name, "prompt": prompt, "max_tokens": 16, "stream": True}
        with httpx.Client(timeout=120) as http, http.stream("POST", f"{url}/v1/completions", json=body) as r:
            out["version"] = r.headers["x-policy-version"]
            out["lines"] = [line for line in r.iter_lines() if line]

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_request_started_before_swap_finishes_on_old_version(broker, engine, topics, adapters, base_model,
                                                            relay: Relay):
    """The old request's answer is held in a relay between gateway and engine until the test has seen the
    swap, so the request is in flight across it on any machine, however slow the swap."""
    name = "inflight"
    publish_version(broker.bootstrap_servers, topics, name, 1, adapters[0], base_model)
    old: dict[str, object] = {}
    relay.hold_marker = b"held across the swap"
    config = gateway_config(broker, engine, name, upstreams=(relay.url,), keep_previous_versions=0)
    with GatewayServer(config) as gw:
        wait_routed(gw, 1)  # caught up on start
        thread = held_stream(gw.url, name, "held across the swap", old)
        try:
            assert relay.holding.wait(30), "the request did not reach the engine"
            assert gw.gateway.router.versions[1].in_flight == 1
            publish_version(broker.bootstrap_servers, topics, name, 2, adapters[1], base_model)
            wait_routed(gw, 2)
            assert gw.gateway.router.versions[1].in_flight == 1  # v1 held by the running stream
            assert f"{name}@v1" in engine_adapters(engine)  # so it stays loaded
            new = httpx.post(f"{gw.url}/v1/completions", json={"model": name, "prompt": "a", "max_tokens": 4},
                             timeout=120)
            assert new.status_code == 200 and new.headers["x-policy-version"] == "2"
            assert new.json()["model"] == f"{name}@v2"
        finally:
            relay.release()
            thread.join(120)
        assert old["version"] == "1"
        lines = old["lines"]
        assert isinstance(lines, list) and lines[-1] == "data: [DONE]"
        chunks = [line for line in lines if line.startswith("data: {")]
        assert chunks and all(f'"model":"{name}@v1"' in line for line in chunks)
        wait_unloaded(engine, f"{name}@v1")  # drained, so unloaded


def test_a_load_waiting_for_room_gives_way_to_a_newer_version(broker, engine, topics, adapters, base_model,
                                                              relay: Relay, caplog: pytest.LogCaptureFixture):
    """Two versions loaded at most: v1 held by a running stream, v2 routed, so v3 waits for v1 to drain. v4,
    published while v3 waits, is taken at once, and it is v4 that is loaded when v1 drains: v3 never is (the
    engine's own log), so the newest version is not served a load later than it could be."""
    name = f"roomwait{uuid.uuid4().hex[:6]}"  # the engine's log, counted below, outlives a test session
    publish_version(broker.bootstrap_servers, topics, name, 1, adapters[0], base_model)
    held: dict[str, object] = {}
    relay.hold_marker = b"held for room"
    config = gateway_config(broker, engine, name, upstreams=(relay.url,), max_loaded_versions=2,
                            keep_previous_versions=0)
    with GatewayServer(config) as gw:
        wait_routed(gw, 1)
        thread = held_stream(gw.url, name, "held for room", held)
        try:
            assert relay.holding.wait(30), "the request did not reach the engine"
            publish_version(broker.bootstrap_servers, topics, name, 2, adapters[1], base_model)
            wait_routed(gw, 2)
            publish_version(broker.bootstrap_servers, topics, name, 3, adapters[2], base_model)
            deadline = time.monotonic() + 30
            while f"{name}@v3 waits for an older version to drain" not in caplog.text:
                assert time.monotonic() < deadline, "v3 did not wait for room"
                time.sleep(0.01)
            publish_version(broker.bootstrap_servers, topics, name, 4, adapters[3], base_model)
            while 4 not in gw.gateway.follower.plan.records:  # taken while v3 waits, not after
                assert time.monotonic() < deadline + 30, "v4 not taken while v3 waited for room"
                time.sleep(0.01)
            assert gw.gateway.router.version == 2 and gw.gateway.router.versions[1].in_flight == 1
        finally:
            relay.release()
            thread.join(120)
        assert held["version"] == "1"
        wait_routed(gw, 4)
        assert engine_loads(engine, f"{name}@v4") == 1 and engine_loads(engine, f"{name}@v3") == 0


def test_in_flight_a_moved_request_no_longer_holds_its_version(broker, engine, topics, adapters, base_model,
                                                              relay: Relay, caplog: pytest.LogCaptureFixture):
    """The ``in-flight`` update mode with two versions loaded at most: a stream on v1 is kept open (its answer
    held in the relay), v2 is routed, and once a request on v2 has come back from the engine (the route
    announcement or the next request: the engine moves every marked request sent before it to v2 at that step),
    the open stream's lease counts against v2: v1 drains and
    is unloaded while the stream is still open, and v3 is loaded without waiting for room. In the ``pinned``
    mode the same stream holds v1 until it ends (``test_a_load_waiting_for_room_gives_way_to_a_newer_version``)."""
    name = f"roommove{uuid.uuid4().hex[:6]}"
    publish_version(broker.bootstrap_servers, topics, name, 1, adapters[0], base_model)
    held: dict[str, object] = {}
    relay.hold_marker = b"held while it moves"
    config = gateway_config(broker, engine, name, upstreams=(relay.url,), max_loaded_versions=2,
                            keep_previous_versions=0, update_mode="in-flight")
    with GatewayServer(config) as gw:
        wait_routed(gw, 1)
        router, up = gw.gateway.router, gw.gateway.pool.upstreams[0]
        deadline = time.monotonic() + 30
        while not up.moves_requests:  # read from the engine's probe at a health check
            assert time.monotonic() < deadline, "the gateway does not know that the engine moves requests"
            time.sleep(0.01)
        thread = held_stream(gw.url, name, "held while it moves", held)
        try:
            assert relay.holding.wait(30), "the request did not reach the engine"
            assert [lease.holds for lease in router.marked] == [1]  # sent marked to move
            publish_version(broker.bootstrap_servers, topics, name, 2, adapters[1], base_model)
            wait_routed(gw, 2)
            # no assertion that v1 still holds the stream here: the route announcement (a marked one-token request
            # on v2, ``PolicyFollower._announce``) may already have come back and moved it
            new = httpx.post(f"{gw.url}/v1/completions", json={"model": name, "prompt": "a", "max_tokens": 4},
                             timeout=120)
            assert new.status_code == 200 and new.headers["x-policy-version"] == "2"
            wait_unloaded(engine, f"{name}@v1")  # the open stream moved: v1 drained
            assert thread.is_alive() and router.moved_leases == 1 and router.versions[2].in_flight == 1
            publish_version(broker.bootstrap_servers, topics, name, 3, adapters[2], base_model)
            wait_routed(gw, 3)
            assert f"{name}@v3 waits for an older version" not in caplog.text
        finally:
            relay.release()
            thread.join(120)
        assert held["version"] == "1"  # the client's answer is an ordinary one, named by the version it began on
        lines = held["lines"]
        assert isinstance(lines, list) and lines[-1] == "data: [DONE]"
        deadline = time.monotonic() + 30  # the gateway lets go of a stream's lease once it has closed it
        while router.marked or any(s.in_flight for s in router.versions.values()):
            assert time.monotonic() < deadline, (router.marked, router.state())
            time.sleep(0.01)


def test_catch_up_bad_checksum_and_max_loaded(broker, engine, topics, adapters, base_model):
    name = "catchup"
    for version, path in enumerate(adapters[:2], start=1):
        publish_version(broker.bootstrap_servers, topics, name, version, path, base_model)
    with GatewayServer(gateway_config(broker, engine, name, max_loaded_versions=2, keep_previous_versions=0)) as gw:
        assert gw.gateway.router.version == 2  # the latest, before the first request was served
        assert f"{name}@v1" not in engine_adapters(engine)  # intermediate versions are skipped
        r = httpx.post(f"{gw.url}/v1/chat/completions", json={"model": name, "messages": CHAT, "max_tokens": 3})
        assert r.headers["x-policy-version"] == "2"

        # a record whose sha256 does not match the weights is never served
        bad = PolicyRecord(name=name, version=3, path=str(adapters[2]), base_model=base_model, step=3,
                           sha256="0" * 64)
        producer = make_producer(broker.bootstrap_servers)
        producer.send(topics.policy, key=name.encode(), value=encode(bad)).get(timeout=30)
        producer.close()
        deadline = time.monotonic() + 30
        while gw.gateway.follower.rejected < 1:
            assert time.monotonic() < deadline, "version with a wrong sha256 not rejected"
            time.sleep(0.01)
        assert gw.gateway.router.version == 2 and f"{name}@v3" not in engine_adapters(engine)

        publish_version(broker.bootstrap_servers, topics, name, 4, adapters[3], base_model)
        wait_routed(gw, 4)
        wait_unloaded(engine, f"{name}@v2")
        loaded = {a for a in engine_adapters(engine) if a.startswith(name)}
        assert loaded == {f"{name}@v4"} and len(gw.gateway.router.versions) <= 2


def test_kept_versions_must_leave_room_for_the_routed_and_the_next_one() -> None:
    assert GatewayConfig(upstreams=("http://x",)).keep_previous_versions == 1
    GatewayConfig(upstreams=("http://x",), max_loaded_versions=4, keep_previous_versions=2)
    for kw in ({"max_loaded_versions": 2}, {"keep_previous_versions": -1}):
        with pytest.raises(ValueError, match="keep_previous_versions must be between 0 and"):
            GatewayConfig(upstreams=("http://x",), **kw)


def test_a_pinned_episode_keeps_its_retired_version_until_it_ends(broker, engine, topics, adapters, base_model,
                                                                 relay: Relay):
    """An episode of several calls pinned to v1 (an agent's held-out game, a move a call) goes on after v2 retired
    v1 (no previous version kept): its first call is held in the relay across the swap, and each next call comes
    within ``pinned_hold_s`` of the last one's end, so v1 is held, not unloaded, and answers them. Once the
    episode has ended and the hold has run out, v1 is unloaded, and a call pinned to it gets a 404."""
    name = f"pinhold{uuid.uuid4().hex[:6]}"
    publish_version(broker.bootstrap_servers, topics, name, 1, adapters[0], base_model)
    first: dict[str, object] = {}
    relay.hold_marker = b"the first move"
    config = gateway_config(broker, engine, name, upstreams=(relay.url,), keep_previous_versions=0,
                            pinned_hold_s=PINNED_HOLD_S)
    with GatewayServer(config) as gw:
        wait_routed(gw, 1)
        thread = held_stream(gw.url, f"{name}@v1", "the first move", first)
        try:
            assert relay.holding.wait(30), "the first move did not reach the engine"
            publish_version(broker.bootstrap_servers, topics, name, 2, adapters[1], base_model)
            wait_routed(gw, 2)
            wait_retired(gw, 1)
        finally:
            relay.release()
            thread.join(120)
        assert first["version"] == "1"
        with httpx.Client(base_url=gw.url, timeout=120) as http:
            def move(n: int) -> httpx.Response:
                return http.post("/v1/completions", json={"model": f"{name}@v1", "prompt": f"move {n}",
                                                          "max_tokens": 2})
            for n in range(2, 5):  # the episode's next moves, each right after the last
                r = move(n)
                assert r.status_code == 200 and r.headers["x-policy-version"] == "1", (n, r.status_code, r.text)
            assert 1 in gw.gateway.follower.plan.retiring and f"{name}@v1" in engine_adapters(engine)
            wait_unloaded(engine, f"{name}@v1")  # the episode over: let go once the hold ran out
            assert move(5).status_code == 404


def test_a_pinned_version_is_let_go_when_its_episodes_end(broker, engine, topics, adapters, base_model):
    """Two episodes pinned to v1 after v2 retired it: one a held-out game that posts no reward (its
    ``Trajectory`` block says it ended, ``POST /v1/trajectories/end``), one that posts a reward. With a hold of
    10 minutes v1 stays held while either may still call; once both ended it is unloaded at once, so a fast
    pipeline's next version does not wait for room behind evaluations already over (docs/gateway.md)."""
    from streamrl.producers.client import Gateway

    name = f"pinhold{uuid.uuid4().hex[:6]}"
    publish_version(broker.bootstrap_servers, topics, name, 1, adapters[0], base_model)
    config = gateway_config(broker, engine, name, keep_previous_versions=0, pinned_hold_s=600.0)
    with GatewayServer(config) as gw, Gateway(gw.url) as client:
        wait_routed(gw, 1)
        game, rewarded = client.trajectory(purpose="eval"), client.trajectory(group_id="g", group_size=1)

        def move(t, n: int) -> None:
            r = t.client.completions.with_raw_response.create(model=f"{name}@v1", prompt=f"move {n}", max_tokens=2)
            assert r.headers["x-policy-version"] == "1", n

        with game:
            with rewarded:
                move(game, 1)
                move(rewarded, 1)
                publish_version(broker.bootstrap_servers, topics, name, 2, adapters[1], base_model)
                wait_routed(gw, 2)
                wait_retired(gw, 1)
                move(game, 2)  # retired, yet held for both episodes
                move(rewarded, 2)
                rewarded.reward(1.0)
            assert gw.gateway.router.held() == {1}, "the rewarded episode ended; the game may still call v1"
            move(game, 3)
        wait_unloaded(engine, f"{name}@v1")  # both ended: let go long before the hold would have run out
        bad = httpx.post(f"{gw.url}/v1/trajectories/end", json={"trajectory_ids": []})
        assert bad.status_code == 400 and "trajectory_ids" in bad.text
        assert httpx.post(f"{gw.url}/v1/trajectories/end", json={"trajectory_ids": [game.trajectory_id]}).json() \
            == {"ended": 0}, "an episode ends once"


def test_a_stopping_gateway_lets_an_adapter_load_in_flight_end(broker, engine, topics, adapters, base_model,
                                                               relay: Relay, caplog: pytest.LogCaptureFixture,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The answer to a load is held in the relay while the gateway stops: the stop waits for it (an engine stopped
    in the middle of a load hangs until killed, and ``streamrl up`` stops the engines next), starts no other load,
    and ends anyway once ``LOAD_SETTLE_S`` has passed."""
    monkeypatch.setattr(hotswap, "LOAD_SETTLE_S", 1.0)
    name = f"settle{uuid.uuid4().hex[:8]}"  # the engine's log, where its loads are counted, outlives the session
    config = gateway_config(broker, engine, name, upstreams=(relay.url,))
    for version, released_after_s in ((1, 0.5), (2, None)):  # the load's answer let through, then never
        relay.hold_again()
        relay.hold_marker = f'"{name}@v{version}"'.encode()
        gw = GatewayServer(config).start()
        try:
            publish_version(broker.bootstrap_servers, topics, name, version, adapters[version - 1], base_model)
            assert relay.holding.wait(30), "the load did not reach the engine"
        finally:
            if released_after_s is not None:
                threading.Timer(released_after_s, relay.release).start()
            started = time.monotonic()
            gw.stop()
            took = time.monotonic() - started
        if released_after_s is not None:
            assert took >= released_after_s, f"the stop did not wait for the load in flight ({took:.2f} s)"
            assert f"letting the adapter loads in flight end first ({name}@v1 into" in caplog.text
            assert "adapter loads still in flight" not in caplog.text
        else:
            assert hotswap.LOAD_SETTLE_S <= took < hotswap.LOAD_SETTLE_S + 10, f"stopped in {took:.1f} s"
            assert f"adapter loads still in flight 1 s into the stop: left ({name}@v2 into" in caplog.text
            relay.release()
        deadline = time.monotonic() + 30  # the load itself goes through in the engine, once
        while f"{name}@v{version}" not in engine_adapters(engine):
            assert time.monotonic() < deadline, f"{name}@v{version} was not loaded"
            time.sleep(0.05)
        assert engine_loads(engine, f"{name}@v{version}") == 1
