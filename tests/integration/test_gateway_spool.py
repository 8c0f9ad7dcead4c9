"""The gateway's spool end to end: a real gateway in front of the real vLLM engine, a broker of the
test's own that is stopped and started again (the embedded broker keeps its log in memory, so it comes
back empty), and a gateway killed with SIGKILL holding records in its spool. Nothing may be lost:
every completion's record and every reward arrives once the broker is back, each trajectory's
completions in the order they were made."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from support.kafka_reader import LogReader, wait_until
from support.services import LOG_DIR

from streamrl.broker.embedded import EmbeddedBroker, free_port
from streamrl.broker.schema import CompletionRecord, RewardRecord, decode
from streamrl.broker.topics import Topics
from streamrl.child import spawn, stop_group, wait_http
from streamrl.engine.server import Engine
from streamrl.gateway.config import GatewayConfig, GatewayKafka
from streamrl.gateway.server import GatewayServer

CHAT = [{"role": "user", "content": "Count with me: one, two"}]


@pytest.fixture
def own_broker(request: pytest.FixtureRequest) -> Iterator[EmbeddedBroker]:
    """A broker this test may stop and start (not started yet), with topics of its own."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    b = EmbeddedBroker(topics=Topics(f"spool-{request.node.name[:20]}"), partitions=2,
                       log_file=LOG_DIR / "broker-gateway-spool.log")
    yield b
    b.stop()


def chat(url: str, model: str, trajectory: str) -> str:
    """One chat call through the gateway; its request id (the call must succeed)."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model=model, messages=CHAT, max_tokens=4,
                                                           extra_headers={"X-Trajectory-Id": trajectory})
    assert raw.http_response.status_code == 200
    return raw.headers["x-request-id"]


def traffic(url: str, model: str, tag: str, trajectories: int = 3, calls: int = 3) -> tuple[dict, dict]:
    """Calls and rewards as an agent makes them: per trajectory, its calls, then its reward. Returns the
    request ids per trajectory, in order, and the reward per trajectory."""
    sent: dict[str, list[str]] = {}
    rewards: dict[str, float] = {}
    for t in range(trajectories):
        traj = f"{tag}-{t}"
        sent[traj] = [chat(url, model, traj) for _ in range(calls)]
        rewards[traj] = t + 0.25
        r = httpx.post(f"{url}/v1/rewards", json={"trajectory_id": traj, "reward": rewards[traj]}, timeout=60)
        assert r.status_code == 200 and r.json() == {"accepted": 1}
    return sent, rewards


def arrived(reader: LogReader, topics: Topics, count: int) -> tuple[dict, dict]:
    """What reached Kafka: request ids per trajectory in log order, reward per trajectory (each once)."""
    completions: dict[str, list[str]] = {}
    rewards: dict[str, float] = {}
    for topic, _, _, value in reader.read_until(count):
        rec = decode(value)
        if topic == topics.completions:
            assert isinstance(rec, CompletionRecord)
            completions.setdefault(rec.trajectory_id, []).append(rec.request_id)
        else:
            assert isinstance(rec, RewardRecord) and rec.trajectory_id not in rewards
            rewards[rec.trajectory_id] = rec.reward
    return completions, rewards


def spool_state(url: str) -> dict:
    return httpx.get(f"{url}/health").json()["spool"]


def test_gateway_serves_through_a_broker_outage_and_loses_nothing(engine: Engine, base_model: str,
                                                                  own_broker: EmbeddedBroker,
                                                                  tmp_path: Path) -> None:
    broker, topics = own_broker.start(), own_broker.topics
    config = GatewayConfig(upstreams=(engine.url,),
                           kafka=GatewayKafka(bootstrap_servers=broker.bootstrap_servers, topic_prefix=topics.prefix),
                           port=free_port(), follow_policy=False, health_interval_s=0.5,
                           spool_dir=str(tmp_path), spool_after_ms=300, producer_send_timeout_ms=3_000)
    with GatewayServer(config) as gw:
        before = traffic(gw.url, base_model, "before", trajectories=1)
        reader = LogReader(broker.bootstrap_servers, [topics.completions, topics.rewards])
        assert arrived(reader, topics, 4) == before
        reader.close()
        wait_until(lambda: not spool_state(gw.url)["completions"]["spooling"], "records straight to Kafka")
        broker.stop()
        during = traffic(gw.url, base_model, "during")  # every call and every reward answered 200
        wait_until(lambda: spool_state(gw.url)["completions"]["records"] == 9, "completions spooled")
        spool = spool_state(gw.url)
        assert spool["rewards"]["records"] == 3 and not spool["full"]
        assert httpx.get(f"{gw.url}/health").json()["status"] == "ok"
        broker.start()  # the same port, an empty log
        reader = LogReader(broker.bootstrap_servers, [topics.completions, topics.rewards])
        assert arrived(reader, topics, 12) == during
        reader.close()
        wait_until(lambda: spool_state(gw.url)["completions"]["records"] == 0, "spool drained")
        spool = spool_state(gw.url)
        assert spool["completions"]["replayed"] >= 9 and spool["rewards"]["replayed"] >= 3
        assert spool["completions"]["dropped"] == spool["rewards"]["dropped"] == 0
        metrics = httpx.get(f"{gw.url}/metrics").text
        assert 'streamrl_gateway_spool_records_total{outcome="dropped",stream="completions"} 0.0' in metrics
        assert 'streamrl_gateway_spool_waiting{stream="rewards"} 0.0' in metrics
        assert "streamrl_gateway_records_undelivered_total 0.0" in metrics


def test_gateway_killed_with_records_in_its_spool_delivers_them_when_restarted(
        engine: Engine, base_model: str, own_broker: EmbeddedBroker, tmp_path: Path) -> None:
    """The broker down; the gateway (``streamrl gateway``, with its producer process) spools what it is
    given; SIGKILL to its whole process group; a new gateway on the same spool directory; the broker
    back: all of it arrives."""
    topics = own_broker.topics
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [str(Path(sys.executable).with_name("streamrl")), "gateway", "--upstream", engine.url,
           "--bootstrap-servers", own_broker.bootstrap_servers, "--port", str(port), "--topic-prefix",
           topics.prefix, "--no-follow-policy", "--spool-dir", str(tmp_path), "--spool-after-ms", "300",
           "--producer-send-timeout-ms", "3000"]
    proc = spawn(cmd, log=LOG_DIR / "gateway-kill9.log")
    try:
        wait_http(url, 120, proc, what="gateway")
        sent = traffic(url, base_model, "killed")
        wait_until(lambda: spool_state(url)["completions"]["records"] == 9, "completions spooled")
        assert spool_state(url)["rewards"]["records"] == 3
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc = spawn(cmd, log=LOG_DIR / "gateway-kill9.log")
        wait_http(url, 120, proc, what="gateway")
        # (the producer process opens its spool a moment after the gateway answers)
        wait_until(lambda: spool_state(url)["completions"]["records"] == 9, "the spool found again")
        assert spool_state(url)["rewards"]["records"] == 3
        own_broker.start()
        reader = LogReader(own_broker.bootstrap_servers, [topics.completions, topics.rewards])
        assert arrived(reader, topics, 12) == sent
        reader.close()
        wait_until(lambda: spool_state(url)["completions"]["records"] == 0 == spool_state(url)["rewards"]["records"],
                   "spools drained")
        assert spool_state(url)["completions"]["replayed"] == 9
    finally:
        stop_group(proc, 30)
