"""API keys with scopes (``gateway/auth.py``) and the policy topic's trust (``gateway/trust.py``), against the
real gateway in front of the session's vLLM server, with the official openai client."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from streamrl.broker.embedded import EmbeddedBroker, free_port
from streamrl.broker.policy_log import PolicyLog, publish_version
from streamrl.broker.schema import WEIGHTS_FILE, CompletionRecord, PolicyRecord, RewardRecord, sha256_file
from streamrl.broker.topics import Topics, create_topics
from streamrl.engine.server import Engine
from streamrl.gateway.auth import (
    ENV_VAR,
)
from streamrl.gateway.config import GatewayConfig, GatewayKafka
from streamrl.gateway.server import GatewayServer
from streamrl.tiny_model import random_adapter

TOPICS = Topics("authtest")
NAME = "trusted"
CHAT = [{"role": "user", "content": "Say something."}]
KEYS = {  # key -> (scopes, id)
    "sk-team-a-0123456789abcdef": ("inference,rewards", "team-a"),
    "sk-rewarder-0123456789abcd": ("rewards", "rewarder"),
    "sk-ops-0123456789abcdef0123": ("admin", "ops"),
    "sk-evals-0123456789abcdef01": ("inference,admin", "evals"),
}
TEAM_A, REWARDER, OPS, EVALS = KEYS
TRAINER = "trainer-a"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# -- binding ---------------------------------------------------------------------------------------


def test_the_gateway_command_refuses_a_public_address_without_keys() -> None:
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    proc = subprocess.run([sys.executable, "-m", "streamrl.cli", "gateway", "--host", "0.0.0.0", "--port", "0", "--no-logging",
                           "--upstream", "http://127.0.0.1:9"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "streamrl gateway: the gateway would listen on 0.0.0.0 with no API keys" in proc.stderr
    assert "Traceback" not in proc.stderr


# -- the real gateway ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def adapter_dirs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapter-root")
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    return {"root": root, "v1": random_adapter(tiny_model, root / "v1", seed=1),
            "last": random_adapter(tiny_model, root / "last", seed=2),
            "outside": random_adapter(tiny_model, elsewhere / "outside", seed=3)}


@pytest.fixture(scope="module")
def gw(broker: EmbeddedBroker, engine: Engine, adapter_dirs: dict[str, Path],
       tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    create_topics(broker.bootstrap_servers, TOPICS, partitions=1)
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("".join(f"{key} {scopes} {key_id}\n" for key, (scopes, key_id) in KEYS.items()))
    config = GatewayConfig(upstreams=(engine.url,),
                           kafka=GatewayKafka(bootstrap_servers=broker.bootstrap_servers, topic_prefix=TOPICS.prefix),
                           port=free_port(), policy_name=NAME, health_interval_s=0.5,
                           api_keys=str(keys), adapter_root=str(adapter_dirs["root"]),
                           trusted_publishers=(TRAINER,))
    with GatewayServer(config) as server:
        yield server
    for card in httpx.get(f"{engine.url}/v1/models").json()["data"]:
        if card.get("parent") and card["id"].startswith(f"{NAME}@"):
            httpx.post(f"{engine.url}/v1/unload_lora_adapter", json={"lora_name": card["id"]})


@pytest.fixture
def log_topics() -> Topics:
    return TOPICS


def client(gw: GatewayServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)


def test_a_right_key_is_served_and_its_id_tags_the_records(gw, base_model, completions) -> None:
    raw = client(gw, TEAM_A).chat.completions.with_raw_response.create(model=base_model, messages=CHAT,
                                                                       max_tokens=4)
    assert raw.parse().choices[0].message is not None
    request_id = raw.headers["x-request-id"]
    (record,) = completions.wait_for(lambda r: isinstance(r, CompletionRecord) and r.request_id == request_id)
    assert record.key_id == "team-a"
    listed = client(gw, EVALS).models.list()
    assert NAME in {m.id for m in listed.data}
    assert gw.gateway.producer is not None and gw.gateway.producer.security == gw.config.kafka


def test_a_wrong_or_missing_key_is_401(gw, base_model) -> None:
    with pytest.raises(openai.AuthenticationError) as err:
        client(gw, "sk-not-a-key-0123456789").chat.completions.create(model=base_model, messages=CHAT, max_tokens=2)
    assert err.value.status_code == 401
    body = err.value.response.json()["error"]
    assert (body["type"], body["code"]) == ("AuthenticationError", "invalid_api_key")
    for headers in ({}, {"Authorization": f"Basic {TEAM_A}"}):
        r = httpx.post(f"{gw.url}/v1/chat/completions", json={"model": base_model, "messages": CHAT},
                       headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["code"] in ("missing_api_key", "invalid_api_key")


def test_a_key_without_the_scope_is_403(gw, base_model) -> None:
    for call in (lambda c: c.chat.completions.create(model=base_model, messages=CHAT, max_tokens=2),
                 lambda c: c.completions.create(model=base_model, prompt="1 2 3", max_tokens=2),
                 lambda c: c.models.list()):
        with pytest.raises(openai.PermissionDeniedError) as err:
            call(client(gw, REWARDER))
        assert err.value.response.json()["error"]["code"] == "insufficient_scope"
        assert "rewarder" in err.value.message and "inference" in err.value.message


def test_rewards_need_the_rewards_scope_and_carry_the_key_id(gw, rewards) -> None:
    item = {"trajectory_id": "auth-t1", "reward": 0.5, "group_id": "auth-g", "group_size": 2}
    r = httpx.post(f"{gw.url}/v1/rewards", json=[item, {**item, "trajectory_id": "auth-t2"}],
                   headers=bearer(REWARDER))
    assert r.status_code == 200 and r.json() == {"accepted": 2}
    got = rewards.wait_for(lambda x: isinstance(x, RewardRecord) and x.trajectory_id.startswith("auth-t"), count=2)
    assert {x.key_id for x in got} == {"rewarder"}
    denied = httpx.post(f"{gw.url}/v1/rewards", json=item, headers=bearer(EVALS))
    assert denied.status_code == 403 and denied.json()["error"]["type"] == "PermissionDeniedError"
    spoofed = httpx.post(f"{gw.url}/v1/rewards", json={**item, "key_id": "someone-else"}, headers=bearer(TEAM_A))
    assert spoofed.status_code == 400 and "key_id" in spoofed.json()["error"]["message"]


def test_metrics_need_admin_and_health_detail_too(gw) -> None:
    assert httpx.get(f"{gw.url}/metrics").status_code == 401
    assert httpx.get(f"{gw.url}/metrics", headers=bearer(TEAM_A)).status_code == 403
    r = httpx.get(f"{gw.url}/metrics", headers=bearer(OPS))
    assert r.status_code == 200 and 'streamrl_gateway_policy_rejected_total{reason="publisher"}' in r.text
    # /health stays open for load balancers; its detail is for admin keys
    assert httpx.get(f"{gw.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{gw.url}/health", headers=bearer(TEAM_A)).json() == \
        {"status": "ok", "policy": {"name": NAME, "version": gw.gateway.router.version}}
    assert httpx.get(f"{gw.url}/health", headers=bearer("sk-not-a-key-0123456789")).status_code == 401
    detail = httpx.get(f"{gw.url}/health", headers=bearer(OPS)).json()
    assert detail["upstreams"][0]["url"] and "producer" in detail


def rejected(gw: GatewayServer) -> dict[str, float]:
    text = httpx.get(f"{gw.url}/metrics", headers=bearer(OPS)).text
    return {line.split('reason="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("streamrl_gateway_policy_rejected_total{")}


def wait_rejected(gw: GatewayServer, count: int) -> None:
    deadline = time.monotonic() + 30
    while gw.gateway.follower.rejected < count:
        assert time.monotonic() < deadline, f"{count} refusals not reached ({gw.gateway.follower.rejected})"
        time.sleep(0.01)


def wait_routed(gw: GatewayServer, version: int) -> None:
    deadline = time.monotonic() + 60
    while gw.gateway.router.version != version:
        assert time.monotonic() < deadline, f"version {version} not routed"
        time.sleep(0.01)


def test_policy_records_are_checked_before_anything_is_loaded(gw, broker, engine, adapter_dirs, base_model,
                                                              tmp_path: Path) -> None:
    """Untrusted publisher, a path leaving the adapter root (directly, through a symlinked directory, through
    a symlinked weights file) and a wrong sha256 are each refused and counted; a trusted record is served,
    and pinning its version needs the admin scope."""
    bootstrap, root = broker.bootstrap_servers, adapter_dirs["root"]
    publish_version(bootstrap, TOPICS, NAME, 1, adapter_dirs["v1"], base_model, publisher=TRAINER)
    wait_routed(gw, 1)
    with pytest.raises(openai.PermissionDeniedError, match="admin"):
        client(gw, TEAM_A).chat.completions.create(model=f"{NAME}@v1", messages=CHAT, max_tokens=2)
    pinned = client(gw, EVALS).chat.completions.with_raw_response.create(model=f"{NAME}@v1", messages=CHAT,
                                                                         max_tokens=2)
    assert pinned.headers["x-policy-version"] == "1"

    outside = adapter_dirs["outside"]
    linked_dir = root / "linked-dir"
    linked_dir.symlink_to(outside, target_is_directory=True)
    linked_weights = root / "linked-weights"
    linked_weights.mkdir()
    for f in outside.iterdir():
        if f.name != WEIGHTS_FILE:
            shutil.copy(f, linked_weights / f.name)
    (linked_weights / WEIGHTS_FILE).symlink_to(outside / WEIGHTS_FILE)
    sha = sha256_file(outside / WEIGHTS_FILE)
    cases = [  # (publisher, path, sha256, reason)
        ("intruder", adapter_dirs["last"], sha256_file(adapter_dirs["last"] / WEIGHTS_FILE), "publisher"),
        (None, adapter_dirs["last"], sha256_file(adapter_dirs["last"] / WEIGHTS_FILE), "publisher"),
        (TRAINER, outside, sha, "outside_root"),
        (TRAINER, linked_dir, sha, "outside_root"),
        (TRAINER, linked_weights, sha, "outside_root"),
        (TRAINER, adapter_dirs["last"], "0" * 64, "sha256"),
    ]
    before = rejected(gw)
    log = PolicyLog(bootstrap, TOPICS)
    try:
        for version, (publisher, path, digest, _) in enumerate(cases, start=2):
            record = PolicyRecord(NAME, version, str(path), base_model, version, digest, publisher=publisher)
            count = gw.gateway.follower.rejected
            log.publish(record)
            wait_rejected(gw, count + 1)
            assert gw.gateway.router.version == 1
    finally:
        log.close()
    after = rejected(gw)
    assert {k: after[k] - before[k] for k in after} == {"publisher": 2, "outside_root": 3, "sha256": 1,
                                                        "malformed": 0}
    loaded = {m["id"] for m in httpx.get(f"{engine.url}/v1/models").json()["data"] if m.get("parent")}
    assert not {f"{NAME}@v{v}" for v in range(2, 2 + len(cases))} & loaded

    last = 2 + len(cases)
    publish_version(bootstrap, TOPICS, NAME, last, adapter_dirs["last"], base_model, publisher=TRAINER)
    wait_routed(gw, last)


def test_the_producer_sdk_sends_its_key_with_calls_and_rewards(gw, base_model, completions, rewards) -> None:
    from streamrl.producers.client import Gateway

    with Gateway(gw.url, api_key=TEAM_A) as sdk, sdk.trajectory(group_id="auth-sdk", group_size=1) as t:
        t.client.chat.completions.create(model=base_model, messages=CHAT, max_tokens=2)
        t.reward(1.0)
    assert t.posted
    (call,) = completions.wait_for(lambda r: isinstance(r, CompletionRecord) and r.trajectory_id == t.trajectory_id)
    (reward,) = rewards.wait_for(lambda r: isinstance(r, RewardRecord) and r.trajectory_id == t.trajectory_id)
    assert call.key_id == reward.key_id == "team-a"
