"""Several policies on one gateway, against the real vLLM server: each policy name routes to its own newest
version, hot-swaps on its own publications only, and the records say which version of which policy served
each call (issue #43's serving half)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from support.kafka_reader import TopicReader

from streamrl.broker.embedded import EmbeddedBroker, free_port
from streamrl.broker.policy_log import publish_version
from streamrl.broker.schema import CompletionRecord, RewardRecord
from streamrl.broker.topics import Topics
from streamrl.engine.server import Engine
from streamrl.gateway.config import GatewayConfig, GatewayKafka
from streamrl.gateway.server import GatewayServer

TOPICS = Topics("policies")
ADAPTER_VERSIONS = 3
NAMES = ("support", "sql")


@pytest.fixture(autouse=True)
def unload_afterwards(engine: Engine) -> Iterator[None]:
    """Leave the shared engine without this module's adapters."""
    yield
    for card in httpx.get(f"{engine.url}/v1/models").json()["data"]:
        if card.get("parent") and card["id"].split("@")[0] in NAMES:
            httpx.post(f"{engine.url}/v1/unload_lora_adapter", json={"lora_name": card["id"]})


def wait_health(gw: GatewayServer, versions: dict[str, int], timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(f"{gw.url}/health").json()
        if {n: health["policies"][n]["version"] for n in versions} == versions:
            return health
        assert time.monotonic() < deadline, f"not routed {versions}: {health['policies']}"
        time.sleep(0.05)


SENT: dict[str, tuple[str, int]] = {}
"""Request id -> (policy, version) the response's headers said."""


def chat(gw: GatewayServer, model: str) -> httpx.Response:
    r = httpx.post(f"{gw.url}/v1/chat/completions", timeout=60,
                   json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert r.status_code == 200, r.text
    SENT[r.headers["x-request-id"]] = (model.split("@")[0], int(r.headers["x-policy-version"]))
    return r


def test_two_policies_route_and_swap_independently(broker: EmbeddedBroker, engine: Engine, topics: Topics,
                                                   adapters, base_model: str) -> None:
    config = GatewayConfig(upstreams=(engine.url,),
                           kafka=GatewayKafka(bootstrap_servers=broker.bootstrap_servers, topic_prefix=topics.prefix),
                           port=free_port(), policy_name=NAMES[0], policies=NAMES,
                           health_interval_s=0.5)
    assert config.policy_names == NAMES
    reader = TopicReader(broker.bootstrap_servers, topics.completions)
    publish = lambda name, v: publish_version(broker.bootstrap_servers, topics, name, v,  # noqa: E731
                                              adapters[v - 1], base_model)
    with GatewayServer(config) as gw:
        wait_health(gw, {"support": 0, "sql": 0})
        models = {card["id"] for card in httpx.get(f"{gw.url}/v1/models").json()["data"]}
        assert set(NAMES) <= models
        for name in NAMES:  # before any version: the base model answers for both
            r = chat(gw, name)
            assert r.headers["x-policy-version"] == "0" and r.json()["model"] == base_model

        publish("sql", 1)
        publish("sql", 2)
        wait_health(gw, {"support": 0, "sql": 2})
        assert chat(gw, "support").headers["x-policy-version"] == "0", "sql's versions never reach support"
        r = chat(gw, "sql")
        assert r.headers["x-policy-version"] == "2" and r.json()["model"] == "sql@v2"

        publish("support", 3)  # a version number sql has not reached: each name counts its own
        health = wait_health(gw, {"support": 3, "sql": 2})
        assert set(health["policies"]["support"]["loaded"]) == {"support@v3"}
        assert "sql@v2" in health["policies"]["sql"]["loaded"]
        r = chat(gw, "support")
        assert r.headers["x-policy-version"] == "3" and r.json()["model"] == "support@v3"
        assert chat(gw, "sql@v2").headers["x-policy-version"] == "2"  # a pinned version of the other policy
        assert health["policy"]["name"] == "support"  # the default policy's view stays where it was
        # the engine's LoRA slots (6 GPU, 8 CPU: tests/support/services.py) hold 2 policies x 3 loaded versions
        assert health["upstreams"][0]["lora"] == {"status": "ok", "max_loras": 6, "max_cpu_loras": 8,
                                                  "max_lora_rank": 16, "needs": {"max_loras": 6, "max_cpu_loras": 6}}
        # the dashboard: every policy listed, each one's versions on its own view
        board = httpx.get(f"{gw.url}/dashboard/data", params={"policy": "sql"}).json()
        assert board["policy"] == {"name": "sql", "version": 2, "served_name": "sql@v2"}
        assert {v["version"] for v in board["versions"] if v["published"]} == {1, 2}
        assert {p["name"]: p["version"] for p in board["policies"]} == {"support": 3, "sql": 2}
        assert [v["version"] for v in httpx.get(f"{gw.url}/dashboard/data").json()["versions"] if v["published"]] == [3]
        assert httpx.get(f"{gw.url}/dashboard/data", params={"policy": "nope"}).status_code == 404

    try:  # each call's record names the policy and the version that served it, as its headers did
        records = reader.wait_for(lambda r: isinstance(r, CompletionRecord) and r.request_id in SENT,
                                  count=len(SENT))
    finally:
        reader.close()
    assert {r.request_id: (r.policy_name, r.policy_version) for r in records} == SENT
    assert sorted(SENT.values()) == [("sql", 0), ("sql", 2), ("sql", 2), ("support", 0), ("support", 0),
                                     ("support", 3)]


def test_an_engine_with_too_few_lora_slots_is_named_in_health_and_the_log(engine: Engine,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    """Three policies need 9 GPU and 9 CPU slots of the engine started by the test session (6 and 8): a warning
    naming them and the flags, ``too_few`` in ``/health``, and it serves on (logging off: nothing else to start)."""
    caplog.set_level(logging.WARNING, "streamrl.gateway.upstreams")
    config = GatewayConfig(upstreams=(engine.url,), port=free_port(), policy_name="a", policies=("b", "c"),
                           follow_policy=False)
    with GatewayServer(config) as gw:
        health = httpx.get(f"{gw.url}/health").json()
        assert health["status"] == "ok" and health["upstreams"][0]["healthy"]
        assert health["upstreams"][0]["lora"] == {"status": "too_few", "max_loras": 6, "max_cpu_loras": 8,
                                                  "max_lora_rank": 16, "needs": {"max_loras": 9, "max_cpu_loras": 9}}
        assert f'streamrl_gateway_upstream_lora_slots_short{{upstream="{engine.url}"}} 1.0' in \
            httpx.get(f"{gw.url}/metrics").text
        r = httpx.post(f"{gw.url}/v1/chat/completions", timeout=60,
                       json={"model": "c", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200 and r.headers["x-policy-version"] == "0"
    [warning] = [r.getMessage() for r in caplog.records if "LoRA slots" in r.getMessage()]
    assert f"upstream {engine.url} has too few LoRA slots for this gateway's 3 policies" in warning
    assert "--max-loras 6 (needs 9), --max-cpu-loras 8 (needs 9)" in warning
    assert "Restart it with --max-loras 9 --max-cpu-loras 9" in warning


SUPPORT_KEY, BOTH_KEY, ADMIN_KEY = "sk-support-" + "a" * 16, "sk-both-" + "b" * 16, "sk-admin-" + "c" * 16


def test_a_key_limited_to_a_policy_uses_and_rewards_it_alone(broker: EmbeddedBroker, engine: Engine,
                                                              topics: Topics, tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text(f"{SUPPORT_KEY} inference,rewards team-support policies=support\n"
                    f"{BOTH_KEY} inference,rewards team-both policies=support,sql\n"
                    f"{ADMIN_KEY} admin,inference,rewards ops\n")
    config = GatewayConfig(upstreams=(engine.url,),
                           kafka=GatewayKafka(bootstrap_servers=broker.bootstrap_servers, topic_prefix=topics.prefix),
                           port=free_port(), policy_name=NAMES[0], policies=NAMES, api_keys=str(keys))
    reader = TopicReader(broker.bootstrap_servers, topics.rewards)
    message = [{"role": "user", "content": "hi"}]
    with GatewayServer(config) as gw:
        support, admin = (openai.OpenAI(base_url=f"{gw.url}/v1", api_key=k, max_retries=0)
                          for k in (SUPPORT_KEY, ADMIN_KEY))
        assert [m.id for m in support.models.list()] == ["support"]
        assert {"support", "sql"} <= {m.id for m in admin.models.list()}
        support.chat.completions.create(model="support", messages=message, max_tokens=2)
        base = next(m.id for m in admin.models.list() if m.id not in NAMES)
        for model in ("sql", base):  # the other policy, and the base model by its own name
            with pytest.raises(openai.PermissionDeniedError, match="may not use"):
                support.chat.completions.create(model=model, messages=message, max_tokens=2)
        admin.chat.completions.create(model="sql", messages=message, max_tokens=2)

        def post(key: str, body: object) -> httpx.Response:
            return httpx.post(f"{gw.url}/v1/rewards", json=body, headers={"authorization": f"Bearer {key}"})

        assert post(SUPPORT_KEY, {"trajectory_id": "s1", "reward": 1.0}).status_code == 200  # its one policy
        denied = post(SUPPORT_KEY, [{"trajectory_id": "s2", "reward": 1.0, "policy": "support"},
                                    {"trajectory_id": "s3", "reward": 1.0, "policy": "sql"}])
        assert denied.status_code == 403 and "may not reward policy 'sql'" in denied.text  # nothing produced
        unsaid = post(BOTH_KEY, {"trajectory_id": "b1", "reward": 1.0})
        assert unsaid.status_code == 400 and "name the policy" in unsaid.text
        assert post(BOTH_KEY, {"trajectory_id": "b2", "reward": 0.5, "policy": "sql"}).status_code == 200
        unknown = post(ADMIN_KEY, {"trajectory_id": "o1", "reward": 1.0, "policy": "nope"})
        assert unknown.status_code == 400 and "not served here" in unknown.text
        assert post(ADMIN_KEY, {"trajectory_id": "o2", "reward": 0.0}).status_code == 200
    try:
        rewards = reader.wait_for(lambda r: isinstance(r, RewardRecord), count=3)
    finally:
        reader.close()
    assert {r.trajectory_id: (r.policy, r.key_id) for r in rewards} == {
        "s1": ("support", "team-support"), "b2": ("sql", "team-both"), "o2": (None, "ops")}
