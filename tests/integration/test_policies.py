"""Several policies on one gateway, against the real vLLM server: each policy name routes to its own newest
version, hot-swaps on its own publications only, and the records say which version of which policy served
each call (issue #43's serving half)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from support.kafka_reader import TopicReader

from streamrl.broker.embedded import EmbeddedBroker, free_port
from streamrl.broker.policy_log import publish_version
from streamrl.broker.schema import CompletionRecord
from streamrl.broker.topics import Topics
from streamrl.engine.server import Engine
from streamrl.gateway.config import GatewayConfig
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
    config = GatewayConfig(upstreams=(engine.url,), bootstrap_servers=broker.bootstrap_servers, port=free_port(),
                           topic_prefix=topics.prefix, policy_name=NAMES[0], policies=NAMES,
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

    try:  # each call's record names the policy and the version that served it, as its headers did
        records = reader.wait_for(lambda r: isinstance(r, CompletionRecord) and r.request_id in SENT,
                                  count=len(SENT))
    finally:
        reader.close()
    assert {r.request_id: (r.policy_name, r.policy_version) for r in records} == SENT
    assert sorted(SENT.values()) == [("sql", 0), ("sql", 2), ("sql", 2), ("support", 0), ("support", 0),
                                     ("support", 3)]
