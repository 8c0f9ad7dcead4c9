"""Upstreams that misbehave: leaving and rejoining the rotation (with an adapter load retried on the one
that missed it), answering late, hanging up on a reused connection, ending a stream late.

The second upstream is the session's real vLLM server reached through a TCP relay (``relay.py``) that
the test can close and reopen on the same port: the gateway sees an upstream go down and come back
without the minute a second vLLM start would take.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from pathlib import Path

import aiohttp
import httpx
import numpy as np
import openai
import orjson
import pytest
from support.kafka_reader import TopicReader
from support.relay import Relay

from streamrl.broker.embedded import EmbeddedBroker, free_port
from streamrl.broker.policy_log import publish_version
from streamrl.broker.schema import CompletionRecord
from streamrl.broker.topics import Topics, create_topics
from streamrl.engine.server import Engine
from streamrl.engine.wire import (
    BODY,
    CAPTURE,
    CAPTURE_HEADER,
    FORMAT_VERSION,
    PROBE_PATH,
    encode_capture,
    frame,
)
from streamrl.gateway.config import GatewayConfig, GatewayKafka
from streamrl.gateway.server import GatewayServer
from streamrl.tiny_model import random_adapter

TOPICS = Topics("upstreams")
CHAT = [{"role": "user", "content": "hello"}]


def wait_until(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_upstream_leaves_and_rejoins_and_gets_the_missed_version(broker: EmbeddedBroker, engine: Engine,
                                                                 relay: Relay, tiny_model: Path,
                                                                 tmp_path: Path) -> None:
    create_topics(broker.bootstrap_servers, TOPICS, partitions=2)
    name = "rejoin"
    base_model = httpx.get(f"{engine.url}/v1/models").json()["data"][0]["id"]
    adapter = random_adapter(tiny_model, tmp_path / "v1", seed=11)
    config = GatewayConfig(upstreams=(engine.url, relay.url),
                           kafka=GatewayKafka(bootstrap_servers=broker.bootstrap_servers, topic_prefix=TOPICS.prefix),
                           port=free_port(), policy_name=name, health_interval_s=0.2, load_retry_s=0.2)
    reader = TopicReader(broker.bootstrap_servers, TOPICS.completions)
    try:
        with GatewayServer(config) as gw:
            direct, relayed = gw.gateway.pool.upstreams
            assert direct.healthy and relayed.healthy

            relay.close()  # the second upstream goes away ...
            wait_until(lambda: not relayed.healthy, "the closed upstream stayed in rotation")
            # ... and misses a version published meanwhile; the policy is served by the other one
            publish_version(broker.bootstrap_servers, TOPICS, name, 1, adapter, base_model)
            wait_until(lambda: gw.gateway.router.version == 1, "version 1 not routed")
            served = f"{name}@v1"
            assert served in direct.adapters and served not in relayed.adapters
            for _ in range(3):
                r = httpx.post(f"{gw.url}/v1/chat/completions", json={"model": name, "messages": CHAT,
                                                                       "max_tokens": 3}, timeout=60)
                assert r.status_code == 200 and r.headers["x-policy-version"] == "1"

            relay.open()  # back: it rejoins the rotation and is given the routed version
            wait_until(lambda: relayed.healthy, "the reopened upstream did not rejoin")
            wait_until(lambda: served in relayed.adapters, "the missed version was not loaded on return")
            ids = []
            for _ in range(6):
                r = httpx.post(f"{gw.url}/v1/chat/completions", json={"model": name, "messages": CHAT,
                                                                       "max_tokens": 3}, timeout=60)
                assert r.status_code == 200 and r.headers["x-policy-version"] == "1"
                ids.append(r.headers["x-request-id"])
            recs = reader.wait_for(lambda x: isinstance(x, CompletionRecord) and x.request_id in ids, count=6)
            assert {x.upstream for x in recs} == {engine.url, relay.url}  # both serve the policy again
            assert all(x.policy_version == 1 for x in recs)
    finally:
        reader.close()
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(f"{engine.url}/v1/unload_lora_adapter", json={"lora_name": f"{name}@v1"})


def test_a_late_health_answer_does_not_eject_but_two_in_a_row_and_a_refusal_do(relay: Relay) -> None:
    """The pool's own checks against the real vLLM server behind the relay, driven one at a time."""
    from streamrl.gateway.upstreams import UpstreamPool

    async def scenario() -> list[tuple[bool, int]]:
        pool = UpstreamPool((relay.url,), timeout_s=0.3, eject_after=2)
        up = pool.upstreams[0]
        seen = []
        connector = aiohttp.TCPConnector(force_close=True)  # every check opens a connection the relay holds
        async with aiohttp.ClientSession(connector=connector) as session:
            pool._session = session
            await pool.check(up)
            seen.append((up.healthy, up.failed_checks))  # healthy to start with
            relay.delay_s = 1.0
            await pool.check(up)
            seen.append((up.healthy, up.failed_checks))  # one late answer: still in rotation
            relay.delay_s = 0.0
            await pool.check(up)
            seen.append((up.healthy, up.failed_checks))  # answered: the count starts again
            relay.delay_s = 1.0
            await pool.check(up)
            await pool.check(up)
            seen.append((up.healthy, up.failed_checks))  # two late answers in a row: out
            relay.delay_s = 0.0
            await pool.check(up)
            seen.append((up.healthy, up.failed_checks))  # back
            relay.close()
            await pool.check(up)
            seen.append((up.healthy, up.failed_checks))  # a refused connection: out at once
        return seen

    assert asyncio.run(scenario()) == [(True, 0), (True, 1), (True, 0), (False, 2), (True, 0), (False, 1)]


def test_a_request_the_upstream_hangs_up_on_is_retried_on_a_new_connection(engine: Engine, relay: Relay) -> None:
    """One upstream that closes kept-alive connections as requests arrive on them (what vLLM's server
    does to an idle connection when its keep-alive timer fires late, under load): every request still
    succeeds, its retry going out on a new connection rather than another stale pooled one."""
    base_model = httpx.get(f"{engine.url}/v1/models").json()["data"][0]["id"]
    body = {"model": base_model, "messages": CHAT, "max_tokens": 2}
    config = GatewayConfig(upstreams=(relay.url,), port=free_port(), health_interval_s=60)

    async def wave(url: str, n: int) -> list[int]:
        async with httpx.AsyncClient(timeout=60) as client:
            replies = await asyncio.gather(*(client.post(f"{url}/v1/chat/completions", json=body) for _ in range(n)))
        return [r.status_code for r in replies]

    def retries(url: str) -> float:
        lines = httpx.get(f"{url}/metrics").text.splitlines()
        return float(next(x for x in lines if x.startswith("streamrl_gateway_upstream_retries_total")).split()[1])

    with GatewayServer(config) as gw:
        assert asyncio.run(wave(gw.url, 12)) == [200] * 12  # 12 connections now idle in the gateway's pool
        relay.hang_up_reused = True
        for _ in range(4):  # one at a time: another idle (stale) connection is always there to be reused
            assert asyncio.run(wave(gw.url, 1)) == [200]
        assert retries(gw.url) >= 4  # each went out on a pooled connection first, was hung up on, retried
        assert gw.gateway.pool.upstreams[0].healthy


def test_an_upstream_slow_to_take_a_connection_is_tried_again(engine: Engine, relay: Relay,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """An upstream that takes no new connection for longer than ``connect_timeout_s`` (its listen queue full:
    the SYN is dropped, as on a host whose CPUs the engine fills): nothing was sent, so the request is tried
    again and served once the upstream takes it; one never taken ends in 504 after two tries."""
    base_model = httpx.get(f"{engine.url}/v1/models").json()["data"][0]["id"]
    body = {"model": base_model, "prompt": "x", "max_tokens": 2}
    caplog.set_level(logging.INFO, "streamrl.gateway.proxy")  # the retry's line is at INFO
    # 2.5 s: the first try's SYN and its resend 1 s later are dropped; the retry's resend, 1 s after the
    # relay opens, gets in well before its own 2.5 s are up
    with GatewayServer(GatewayConfig(upstreams=(relay.url,), port=free_port(), health_interval_s=60,
                                     connect_timeout_s=2.5)) as gw:
        relay.shut()
        answer: dict[str, httpx.Response] = {}
        sender = threading.Thread(target=lambda: answer.update(r=httpx.post(f"{gw.url}/v1/completions",
                                                                            json=body, timeout=60)))
        sender.start()
        wait_until(lambda: "took no connection" in caplog.text,
                   "the first try's connect must time out while the relay takes nothing")
        relay.open()
        sender.join(60)
        assert answer["r"].status_code == 200, answer["r"].text
        assert gw.gateway.pool.upstreams[0].healthy
    with GatewayServer(GatewayConfig(upstreams=(relay.url,), port=free_port(), health_interval_s=60,
                                     connect_timeout_s=0.3)) as gw:
        relay.shut()
        r = httpx.post(f"{gw.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 504 and "took no connection within 0.3 s" in r.json()["error"]["message"], r.text


def test_upstream_timeout_is_504(broker: EmbeddedBroker, engine: Engine, relay: Relay) -> None:
    """An upstream silent for longer than upstream_timeout_s: the client gets 504, and no record is
    produced for the call (the relay holds vLLM's real answer back for 2 s)."""
    create_topics(broker.bootstrap_servers, TOPICS, partitions=2)
    base_model = httpx.get(f"{engine.url}/v1/models").json()["data"][0]["id"]
    config = GatewayConfig(upstreams=(relay.url,),
                           kafka=GatewayKafka(bootstrap_servers=broker.bootstrap_servers, topic_prefix=TOPICS.prefix),
                           port=free_port(), upstream_timeout_s=0.2, follow_policy=False,
                           health_interval_s=60)
    with GatewayServer(config) as gw:
        relay.answer_delay_s = 2.0
        r = httpx.post(f"{gw.url}/v1/completions", timeout=60, json={"model": base_model, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 504 and r.json()["error"]["code"] == 504, r.text
        assert gw.gateway.health()["producer"]["offered"] == 0


def test_a_stream_is_recorded_when_the_client_hangs_up_on_done(broker: EmbeddedBroker, engine: Engine,
                                                               relay: Relay) -> None:
    """The openai client closes the connection as soon as it reads ``[DONE]``. With an upstream slow to
    end the response after it (the relay holds back what follows ``[DONE]``), the gateway's relay of
    the stream is cancelled by that hang-up: the call must have been recorded already."""
    create_topics(broker.bootstrap_servers, TOPICS, partitions=2)
    base_model = httpx.get(f"{engine.url}/v1/models").json()["data"][0]["id"]
    config = GatewayConfig(upstreams=(relay.url,),
                           kafka=GatewayKafka(bootstrap_servers=broker.bootstrap_servers, topic_prefix=TOPICS.prefix),
                           port=free_port(), follow_policy=False, health_interval_s=60)
    reader = TopicReader(broker.bootstrap_servers, TOPICS.completions)
    try:
        with GatewayServer(config) as gw:
            relay.hold_after = b"data: [DONE]\n\n\r\n"  # the SSE event and its chunk's end; not the last chunk
            client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
            stream = client.completions.create(model=base_model, prompt="The weather", max_tokens=6, n=2,
                                               stream=True, extra_headers={"X-Trajectory-Id": "traj-hang-up"})
            texts = {0: "", 1: ""}
            for chunk in stream:
                for c in chunk.choices:
                    texts[c.index] += c.text
            assert relay.holding.is_set()  # the response had not ended when the client hung up
            recs = reader.wait_for(lambda r: isinstance(r, CompletionRecord) and r.trajectory_id == "traj-hang-up",
                                   count=2, explain=lambda: gw.gateway.health()["producer"])
            assert sorted(r.choice_index for r in recs) == [0, 1]
            assert {r.choice_index: r.response_text for r in recs} == texts
            assert all(r.completion_token_ids.size == r.logprobs.size > 0 for r in recs)
    finally:
        reader.close()


class LateCaptureEngine:
    """An upstream speaking ``streamrl engine``'s framed wire that sends a stream's capture frame only after
    ``data: [DONE]``, once the test releases it. The real engine does so only when a choice is not finished
    at [DONE], which cannot be arranged on cue, and the relay moves bytes without reordering frames, so
    this stub stands in for that one path; the gateway, broker and client in front of it are real."""

    MODEL = "late-capture-model"

    def __init__(self) -> None:
        from aiohttp import web

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.release = asyncio.Event()
        self.port = free_port()
        async def health(_: web.Request) -> web.Response:
            return web.Response(text="")

        async def models(_: web.Request) -> web.Response:
            return web.json_response({"data": [{"id": self.MODEL, "parent": None}]})

        async def probe(_: web.Request) -> web.Response:
            return web.json_response({"format": FORMAT_VERSION})

        app = web.Application()
        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", models)
        app.router.add_get(PROBE_PATH, probe)
        app.router.add_post("/v1/completions", self._completions)
        self.runner = web.AppRunner(app)
        asyncio.run_coroutine_threadsafe(self._start(web), self.loop).result(10)

    async def _start(self, web) -> None:
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _completions(self, request):
        from aiohttp import web

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", CAPTURE_HEADER: "1"})
        await resp.prepare(request)
        for text, finish in (("Hello", None), (" there", "length")):
            chunk = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": self.MODEL,
                     "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
            await resp.write(frame(BODY, b"data: " + orjson.dumps(chunk) + b"\n\n"))
        await resp.write(frame(BODY, b"data: [DONE]\n\n"))
        await self.release.wait()  # the client has hung up on [DONE] by now
        capture = encode_capture([np.array([5, 6, 7], np.int32)],
                                 [(0, 0, np.array([11, 12], np.int32), np.array([-0.5, -0.25], np.float32))])
        await resp.write(frame(CAPTURE, capture))
        await resp.write_eof()
        return resp

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def test_a_capture_sent_after_done_is_recorded_after_the_client_left(broker: EmbeddedBroker) -> None:
    """The openai client hangs up on ``[DONE]``; an engine whose capture frame comes after it: the gateway
    reads on to the capture in the background, and the call is recorded with the engine's tokens."""
    create_topics(broker.bootstrap_servers, TOPICS, partitions=2)
    upstream = LateCaptureEngine()
    config = GatewayConfig(upstreams=(upstream.url,),
                           kafka=GatewayKafka(bootstrap_servers=broker.bootstrap_servers, topic_prefix=TOPICS.prefix),
                           port=free_port(), follow_policy=False, health_interval_s=60)
    reader = TopicReader(broker.bootstrap_servers, TOPICS.completions)
    try:
        with GatewayServer(config) as gw:
            assert gw.gateway.pool.upstreams[0].token_capture
            client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
            stream = client.completions.create(model=upstream.MODEL, prompt="hi", max_tokens=2, stream=True,
                                               extra_headers={"X-Trajectory-Id": "traj-late-capture"})
            text = "".join(c.choices[0].text for c in stream)
            stream.close()
            assert text == "Hello there" and gw.gateway.health()["producer"]["offered"] == 0  # nothing yet
            upstream.loop.call_soon_threadsafe(upstream.release.set)
            [rec] = reader.wait_for(lambda r: isinstance(r, CompletionRecord) and r.trajectory_id == "traj-late-capture",
                                    explain=lambda: gw.gateway.health()["producer"])
            assert rec.response_text == "Hello there" and rec.finish_reason == "length"
            assert rec.prompt_token_ids.tolist() == [5, 6, 7] and rec.completion_token_ids.tolist() == [11, 12]
            assert rec.logprobs.tolist() == [-0.5, -0.25]
            assert gw.gateway.pool.upstreams[0].in_flight == 0
    finally:
        reader.close()
        upstream.stop()


def test_a_call_stuck_in_flight_does_not_keep_the_gateway_from_stopping(broker: EmbeddedBroker, engine: Engine,
                                                                        relay: Relay) -> None:
    """A call whose upstream never answers (the relay holds it) is cut once ``shutdown_grace_s`` has passed:
    the gateway stops, and the record of a call answered before is delivered (its producers closed)."""
    create_topics(broker.bootstrap_servers, TOPICS, partitions=2)
    base_model = httpx.get(f"{engine.url}/v1/models").json()["data"][0]["id"]
    config = GatewayConfig(upstreams=(relay.url,),
                           kafka=GatewayKafka(bootstrap_servers=broker.bootstrap_servers, topic_prefix=TOPICS.prefix),
                           port=free_port(), follow_policy=False, health_interval_s=60,
                           shutdown_grace_s=1.0)
    reader = TopicReader(broker.bootstrap_servers, TOPICS.completions)
    gw = GatewayServer(config).start()
    try:
        body = {"model": base_model, "prompt": "before", "max_tokens": 2}
        answered = httpx.post(f"{gw.url}/v1/completions", json=body, headers={"X-Trajectory-Id": "traj-grace"},
                              timeout=60)
        assert answered.status_code == 200
        relay.hold_marker = b"stuck-in-flight"
        stuck: list[BaseException | httpx.Response] = []

        def call() -> None:
            try:
                stuck.append(httpx.post(f"{gw.url}/v1/completions", timeout=120,
                                        json={**body, "prompt": "stuck-in-flight"}))
            except httpx.HTTPError as exc:
                stuck.append(exc)
        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        assert relay.holding.wait(60)
        started = time.monotonic()
        gw.stop(timeout_s=60)
        assert not gw.running and time.monotonic() - started < 30
        caller.join(60)
        assert stuck and not (isinstance(stuck[0], httpx.Response) and stuck[0].status_code == 200), stuck
        rec = reader.wait_for(lambda r: isinstance(r, CompletionRecord) and r.trajectory_id == "traj-grace")[0]
        assert rec.request_id == answered.headers["x-request-id"]
    finally:
        relay.release()
        gw.stop()
        reader.close()
