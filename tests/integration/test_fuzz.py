"""The gateway fuzzed from its own OpenAPI document (schemathesis): bodies generated to fit the schema and
to break it, against a real gateway in front of the real vLLM server and the real broker. No answer may be
a 5xx that vLLM itself does not give for the same request, every answer must be one the document declares,
and the gateway must still serve afterwards.

Bounded for the suite: ``max_tokens`` at most 4 (set to 4 where an example leaves it out: vLLM's chat default is the
rest of the context, about 1000 tokens and 2-3 s a call here), a few short messages, 20 examples per route and
mode."""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from streamrl.broker.embedded import EmbeddedBroker, free_port
from streamrl.broker.topics import Topics, create_topics
from streamrl.engine.server import Engine
from streamrl.gateway.config import GatewayConfig, GatewayKafka
from streamrl.gateway.server import GatewayServer

TOPICS = Topics("fuzz")
MAX_TOKENS = 4
EXAMPLES = int(os.environ.get("STREAMRL_FUZZ_EXAMPLES", "20"))
EXPLORE = bool(os.environ.get("STREAMRL_FUZZ_EXPLORE"))
"""The suite runs the same examples every time (a finding must not be a flaky failure); set
``STREAMRL_FUZZ_EXPLORE=1`` (and more ``STREAMRL_FUZZ_EXAMPLES``) to look for new ones."""


@pytest.fixture(scope="module")
def fuzzed(broker: EmbeddedBroker, engine: Engine) -> Iterator[tuple[GatewayServer, Engine]]:
    create_topics(broker.bootstrap_servers, TOPICS, partitions=1)
    config = GatewayConfig(upstreams=(engine.url,),
                           kafka=GatewayKafka(bootstrap_servers=broker.bootstrap_servers, topic_prefix=TOPICS.prefix),
                           port=free_port(), follow_policy=False, health_interval_s=60,
                           max_body_bytes=64 << 10)
    with GatewayServer(config) as gw:
        yield gw, engine


def bounded(document: dict[str, Any], model: str) -> dict[str, Any]:
    """The served document with the model fixed to the served one and the sizes kept small."""
    doc = copy.deepcopy(document)
    schemas = doc["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        props = schemas[name]["properties"]
        props["model"] = {"enum": [model]}
        props["max_tokens"]["maximum"] = MAX_TOKENS
        props["n"]["maximum"] = 2
        props["stop"] = {"type": "string", "maxLength": 8}
    messages = schemas["ChatCompletionRequest"]["properties"]["messages"]
    messages["maxItems"] = 3
    messages["items"]["properties"]["content"]["maxLength"] = 40
    for choice in schemas["CompletionRequest"]["properties"]["prompt"]["oneOf"]:
        choice.update({"maxLength": 40} if choice["type"] == "string" else {"maxItems": 3})
        if choice.get("items", {}).get("type") == "string":
            choice["items"]["maxLength"] = 40
        elif choice.get("items", {}).get("type") == "integer":
            choice["items"]["maximum"] = 2000  # inside the tiny model's vocabulary
    return doc


@pytest.fixture(scope="module")
def api(fuzzed: tuple[GatewayServer, Engine]) -> Any:
    gw, engine = fuzzed
    document = httpx.get(f"{gw.url}/openapi.json").json()
    model = httpx.get(f"{engine.url}/v1/models").json()["data"][0]["id"]
    return schemathesis.openapi.from_dict(bounded(document, model))


def test_the_document_is_served_and_valid_openapi(fuzzed: tuple[GatewayServer, Engine]) -> None:
    gw, _ = fuzzed
    r = httpx.get(f"{gw.url}/openapi.json")
    assert r.status_code == 200
    doc = r.json()
    assert doc["openapi"].startswith("3.1") and set(doc["paths"]) >= {"/v1/chat/completions", "/v1/completions",
                                                                      "/v1/rewards", "/v1/trajectories/end",
                                                                      "/v1/models"}
    schemathesis.openapi.from_dict(doc).validate()  # raises on an invalid document


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/rewards", "/v1/trajectories/end"])
def test_fuzzed_requests_get_no_server_error(api: Any, fuzzed: tuple[GatewayServer, Engine], path: str,
                                             mode: GenerationMode) -> None:
    gw, engine = fuzzed
    operation = api[path]["POST"]
    declared = operation.definition.raw["responses"]
    statuses: set[int] = set()

    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None,
              derandomize=not EXPLORE)
    @given(case=operation.as_strategy(mode))
    def check(case: schemathesis.Case) -> None:
        if path.endswith("completions") and isinstance(case.body, dict):  # never makes a body valid or invalid
            case.body.setdefault("max_tokens", MAX_TOKENS)
        response = case.call(base_url=gw.url, timeout=60)
        statuses.add(response.status_code)
        if response.status_code >= 500:  # only where vLLM answers the same request with the same status
            direct = case.call(base_url=engine.url, timeout=60)
            assert direct.status_code == response.status_code, (case.as_curl_command(), response.text[:500])
        assert str(response.status_code) in declared, (case.as_curl_command(), response.text[:500])

    check()
    assert httpx.get(f"{gw.url}/health").status_code == 200  # still serving
    # what was generated reached the gateway's own checks or vLLM: fitting bodies are served, others refused
    assert statuses & ({200} if mode is GenerationMode.POSITIVE else {400}), statuses
