"""The gateway against real parts: the embedded broker, a vLLM server on the tiny model, the openai client."""

from __future__ import annotations

import time
from collections.abc import Iterator
from urllib.parse import unquote

import httpx
import numpy as np
import openai
import orjson
import pytest
from support.gateway_calls import client, direct, of_request
from support.services import start_gateway

from streamrl.broker.embedded import EmbeddedBroker, free_port
from streamrl.broker.schema import CompletionRecord, RecordError, RewardRecord, decode
from streamrl.broker.topics import Topics
from streamrl.engine.server import Engine
from streamrl.engine.wire import PROBE_PATH
from streamrl.gateway.config import GatewayConfig, GatewayKafka
from streamrl.gateway.server import GatewayServer

TOPICS = Topics("test")  # the prefix of the session's broker fixture
CHAT = [{"role": "user", "content": "Say something about numbers."}]


@pytest.fixture(scope="module")
def json_gateway(broker: EmbeddedBroker, engine: Engine) -> Iterator[GatewayServer]:
    """Tokens asked for in vLLM's JSON: the path a plain vLLM upstream gets (here forced on the same engine)."""
    gw = start_gateway(broker, engine, token_capture=False)
    yield gw
    gw.stop()


@pytest.fixture(params=["engine", "json"])
def gateway(request: pytest.FixtureRequest) -> GatewayServer:
    """Both ways of getting the tokens, for the tests of what is recorded and what the client gets."""
    return request.getfixturevalue(f"{request.param}_gateway")


def assert_record_matches(rec: CompletionRecord, token_ids: list[int], logprobs: list[float],
                          prompt_ids: list[int]) -> None:
    assert rec.completion_token_ids.tolist() == token_ids
    assert rec.prompt_token_ids.tolist() == prompt_ids
    np.testing.assert_array_equal(rec.logprobs, np.asarray(logprobs, dtype=np.float32))


# -- completions through the openai client ------------------------------------------------------------

def test_chat_record_is_token_exact_and_response_unchanged(gateway, engine, base_model, completions):
    sampling = {"max_tokens": 12, "temperature": 1.0, "seed": 1234}
    tokens = ('streamrl_gateway_tokens_total{kind="prompt"}', 'streamrl_gateway_tokens_total{kind="completion"}')
    before = [metric(gateway, name) for name in tokens]
    raw = client(gateway).chat.completions.with_raw_response.create(
        model=base_model, messages=CHAT, extra_headers={"X-Trajectory-Id": "traj-chat", "X-Group-Id": "g-1"},
        **sampling)
    response = raw.parse()
    assert raw.headers["x-trajectory-id"] == "traj-chat"
    # what the client gets is what vLLM returns for the same request: no token ids or logprobs
    plain = direct(engine, "chat/completions", {"model": base_model, "messages": CHAT, **sampling})
    body = raw.http_response.json()
    for key in ("prompt_token_ids", "prompt_logprobs"):
        assert body[key] is None and plain[key] is None
    assert body["choices"][0]["token_ids"] is None and body["choices"][0]["logprobs"] is None
    assert set(body) == set(plain) and set(body["choices"][0]) == set(plain["choices"][0])
    assert response.choices[0].message.content == plain["choices"][0]["message"]["content"]

    rec = completions.wait_for(of_request(raw.headers["x-request-id"]))[0]
    assert (rec.trajectory_id, rec.group_id, rec.endpoint) == ("traj-chat", "g-1", "chat")
    assert (rec.policy_name, rec.policy_version, rec.upstream) == (None, 0, engine.url)
    exact = direct(engine, "chat/completions", {"model": base_model, "messages": CHAT, **sampling,
                                                "logprobs": True, "return_token_ids": True})
    choice = exact["choices"][0]
    assert_record_matches(rec, choice["token_ids"], [e["logprob"] for e in choice["logprobs"]["content"]],
                          exact["prompt_token_ids"])
    assert rec.response_text == response.choices[0].message.content
    assert rec.request["messages"] == CHAT and rec.finish_reason == response.choices[0].finish_reason
    assert rec.usage["completion_tokens"] == response.usage.completion_tokens
    assert [metric(gateway, name) - b for name, b in zip(tokens, before, strict=True)] == [
        response.usage.prompt_tokens, response.usage.completion_tokens]  # counted by /metrics as logged
    # the real vLLM body took the byte-level strip, not the msgspec fallback
    assert metric(gateway, "streamrl_gateway_slow_strips_total") == 0


def test_chat_client_asking_for_ids_gets_them_and_record_equals_them(gateway, base_model, completions):
    raw = client(gateway).chat.completions.with_raw_response.create(
        model=base_model, messages=CHAT, max_tokens=10, logprobs=True, top_logprobs=2,
        extra_body={"return_token_ids": True, "metadata": {"trajectory_id": "traj-meta", "group_id": "g-meta"}})
    body = raw.http_response.json()
    choice = body["choices"][0]
    assert len(choice["logprobs"]["content"][0]["top_logprobs"]) == 2  # the client's own request is kept
    rec = completions.wait_for(of_request(raw.headers["x-request-id"]))[0]
    assert (rec.trajectory_id, rec.group_id) == ("traj-meta", "g-meta")
    assert_record_matches(rec, choice["token_ids"], [e["logprob"] for e in choice["logprobs"]["content"]],
                          body["prompt_token_ids"])


def test_ids_outside_printable_ascii_are_recorded_as_sent_and_echoed_percent_encoded(engine_gateway, base_model,
                                                                                   completions):
    """Response headers carry Latin-1 bytes at most, no control characters: such ids are echoed
    percent-encoded (found by the fuzz test: a 500 before), and recorded exactly as sent."""
    tid, gid = f"traj-Ā\n{time.monotonic_ns()}", "group é"
    r = httpx.post(f"{engine_gateway.url}/v1/chat/completions", timeout=60, json={
        "model": base_model, "messages": CHAT, "max_tokens": 2, "metadata": {"trajectory_id": tid, "group_id": gid}})
    assert r.status_code == 200, r.text
    assert (unquote(r.headers["x-trajectory-id"]), unquote(r.headers["x-group-id"])) == (tid, gid)
    rec = completions.wait_for(of_request(r.headers["x-request-id"]))[0]
    assert (rec.trajectory_id, rec.group_id) == (tid, gid)


def test_chat_streaming_record_matches_vllm(gateway, engine, base_model, completions):
    sampling = {"max_tokens": 16, "temperature": 1.0, "seed": 77}
    with client(gateway).chat.completions.with_streaming_response.create(
            model=base_model, messages=CHAT, stream=True, **sampling) as raw:
        minted = raw.headers["x-trajectory-id"]
        request_id = raw.headers["x-request-id"]
        chunks = list(raw.parse())
    assert minted  # no trajectory id sent: the gateway minted one and returned it
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    for c in chunks:
        extra = c.model_extra or {}
        assert extra.get("prompt_token_ids") is None
        for choice in c.choices:
            assert choice.logprobs is None and (choice.model_extra or {}).get("token_ids") is None
    rec = completions.wait_for(of_request(request_id))[0]
    assert rec.trajectory_id == minted and rec.group_id is None
    exact = direct(engine, "chat/completions", {"model": base_model, "messages": CHAT, **sampling,
                                                "logprobs": True, "return_token_ids": True})
    choice = exact["choices"][0]
    assert_record_matches(rec, choice["token_ids"], [e["logprob"] for e in choice["logprobs"]["content"]],
                          exact["prompt_token_ids"])
    assert rec.response_text == text == choice["message"]["content"]
    assert rec.ttft_s is not None and 0 < rec.ttft_s <= rec.total_s


def test_completions_n2_one_record_per_choice(gateway, engine, base_model, completions):
    sampling = {"max_tokens": 8, "temperature": 1.0, "seed": 5, "n": 2, "stop": ["\n\n"]}
    raw = client(gateway).completions.with_raw_response.create(
        model=base_model, prompt="Once upon a time", extra_headers={"X-Trajectory-Id": "traj-cmpl"}, **sampling)
    body = raw.http_response.json()
    assert all(c["logprobs"] is None and c["token_ids"] is None and c["prompt_token_ids"] is None
               for c in body["choices"])
    recs = completions.wait_for(of_request(raw.headers["x-request-id"]), count=2)
    exact = direct(engine, "completions", {"model": base_model, "prompt": "Once upon a time", **sampling,
                                           "logprobs": 0, "return_token_ids": True})
    by_index = {r.choice_index: r for r in recs}
    assert sorted(by_index) == [0, 1]
    for choice in exact["choices"]:
        rec = by_index[choice["index"]]
        assert rec.endpoint == "completions" and rec.trajectory_id == "traj-cmpl"
        assert_record_matches(rec, choice["token_ids"], choice["logprobs"]["token_logprobs"],
                              choice["prompt_token_ids"])
        assert rec.response_text == body["choices"][choice["index"]]["text"]
    assert metric(gateway, "streamrl_gateway_slow_strips_total") == 0


def test_completions_streaming_n2(gateway, engine, base_model, completions):
    sampling = {"max_tokens": 8, "temperature": 1.0, "seed": 9, "n": 2}
    stream = client(gateway).completions.create(model=base_model, prompt="The weather", stream=True,
                                                stream_options={"include_usage": True},
                                                extra_headers={"X-Trajectory-Id": "traj-cmpl-stream"}, **sampling)
    texts = {0: "", 1: ""}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += c.text
    assert usage is not None and usage.completion_tokens == 16
    recs = completions.wait_for(lambda r: isinstance(r, CompletionRecord) and r.trajectory_id == "traj-cmpl-stream",
                                count=2)
    exact = direct(engine, "completions", {"model": base_model, "prompt": "The weather", **sampling,
                                           "logprobs": 0, "return_token_ids": True})
    by_index = {r.choice_index: r for r in recs}
    for choice in exact["choices"]:
        rec = by_index[choice["index"]]
        assert_record_matches(rec, choice["token_ids"], choice["logprobs"]["token_logprobs"],
                              choice["prompt_token_ids"])
        assert rec.response_text == texts[choice["index"]]


def test_tools_pass_through(gateway, base_model, completions):
    tools = [{"type": "function", "function": {"name": "add", "description": "add two numbers",
              "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]
    raw = client(gateway).chat.completions.with_raw_response.create(
        model=base_model, messages=CHAT, tools=tools, tool_choice="auto", max_tokens=8)
    assert raw.http_response.status_code == 200
    rec = completions.wait_for(of_request(raw.headers["x-request-id"]))[0]
    assert rec.request["tools"] == tools and rec.completion_token_ids.size > 0


def test_models_lists_base_and_policy(engine_gateway, base_model):
    ids = [m.id for m in client(engine_gateway).models.list()]
    assert base_model in ids and "policy" in ids


def test_policy_name_before_first_version_is_base_model_version_0(engine_gateway, base_model, completions):
    raw = client(engine_gateway).chat.completions.with_raw_response.create(model="policy", messages=CHAT, max_tokens=4)
    assert raw.headers["x-policy-version"] == "0" and raw.parse().model == base_model
    rec = completions.wait_for(of_request(raw.headers["x-request-id"]))[0]
    assert (rec.model, rec.policy_name, rec.policy_version) == ("policy", "policy", 0)


# -- rewards ------------------------------------------------------------------------------------------

def test_rewards_single_and_list(engine_gateway, rewards):
    r = httpx.post(f"{engine_gateway.url}/v1/rewards", json={"trajectory_id": "t-r1", "reward": 0.5, "group_id": "g",
                                                      "group_size": 2, "metrics": {"steps": 3}})
    assert r.status_code == 200 and r.json() == {"accepted": 1}
    r = httpx.post(f"{engine_gateway.url}/v1/rewards", json=[{"trajectory_id": "t-r2", "reward": 1},
                                                      {"trajectory_id": "t-r3", "reward": -2.5}])
    assert r.status_code == 200 and r.json() == {"accepted": 2}
    got = {x.trajectory_id: x for x in rewards.wait_for(lambda x: isinstance(x, RewardRecord), count=3)}
    assert (got["t-r1"].reward, got["t-r1"].group_id, got["t-r1"].group_size) == (0.5, "g", 2)
    assert got["t-r1"].metrics == {"steps": 3.0}
    assert (got["t-r2"].reward, got["t-r3"].reward) == (1.0, -2.5)


INVALID_REWARDS = [
    {"trajectory_id": "T", "reward": "1"},
    {"trajectory_id": "T", "reward": True},
    {"trajectory_id": "", "reward": 1},
    {"trajectory_id": "x" * 300, "reward": 1},
    {"reward": 1},
    {"trajectory_id": "T"},
    {"trajectory_id": "T", "reward": 1, "group_size": 0},
    {"trajectory_id": "T", "reward": 1, "metrics": {"m": "high"}},
    {"trajectory_id": "T", "reward": 1, "rewrd": 2},
    [{"trajectory_id": "T", "reward": 1}, {"trajectory_id": "T-bad", "reward": None}],
    [],
    "reward",
]


@pytest.mark.parametrize("case", range(len(INVALID_REWARDS)))
def test_invalid_rewards_are_rejected_and_produce_nothing(engine_gateway, rewards, case):
    tag = f"invalid-{case}-{time.monotonic_ns()}"
    body = orjson.loads(orjson.dumps(INVALID_REWARDS[case]).replace(b'"T', f'"{tag}'.encode()))
    offered = engine_gateway.gateway.producer.stats.offered
    r = httpx.post(f"{engine_gateway.url}/v1/rewards", json=body)
    assert r.status_code == 400 and r.json()["error"]["code"] == 400
    assert engine_gateway.gateway.producer.stats.offered == offered
    sentinel = f"sentinel-{tag}"
    assert httpx.post(f"{engine_gateway.url}/v1/rewards", json={"trajectory_id": sentinel, "reward": 0}).status_code == 200
    rewards.wait_for(lambda x: x.trajectory_id == sentinel)
    assert not [x for x in rewards.seen if x.trajectory_id.startswith(tag)]


def test_non_finite_reward_is_rejected(engine_gateway, rewards):
    r = httpx.post(f"{engine_gateway.url}/v1/rewards", content=b'{"trajectory_id": "t", "reward": NaN}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    r = httpx.post(f"{engine_gateway.url}/v1/rewards", content=b'{"trajectory_id": "t", "reward": 1e999}',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400


# -- bad input ----------------------------------------------------------------------------------------

def test_invalid_json_is_400_with_openai_error(engine_gateway):
    r = httpx.post(f"{engine_gateway.url}/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400 and "JSON" in err["message"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("chat/completions", {"model": "m"}, "messages"),
    ("chat/completions", {"model": "m", "messages": "hi"}, "messages"),
    ("chat/completions", {"messages": CHAT}, "model"),
    ("chat/completions", {"model": "m", "messages": CHAT, "stream": "yes"}, "stream"),
    ("completions", {"model": "m"}, "prompt"),
    ("completions", {"model": "m", "prompt": "x", "n": 0}, "n"),
])
def test_validation_errors_are_400(engine_gateway, path, body, param):
    r = httpx.post(f"{engine_gateway.url}/v1/{path}", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_bad_tags_are_400(engine_gateway, base_model):
    r = httpx.post(f"{engine_gateway.url}/v1/chat/completions", json={"model": base_model, "messages": CHAT},
                   headers={"X-Trajectory-Id": "x" * 1000})
    assert r.status_code == 400 and r.json()["error"]["param"] == "trajectory_id"


def test_unknown_model_is_404(engine_gateway):
    with pytest.raises(openai.NotFoundError) as exc:
        client(engine_gateway).chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=2)
    assert exc.value.status_code == 404


def test_body_over_limit_is_413(engine_gateway, base_model):
    r = httpx.post(f"{engine_gateway.url}/v1/chat/completions",
                   json={"model": base_model, "messages": [{"role": "user", "content": "x" * (70 << 10)}]})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413


def test_upstream_error_keeps_status_and_body(gateway, engine, base_model, completions):
    body = {"model": base_model, "messages": CHAT, "max_tokens": 4, "temperature": -1}
    via = httpx.post(f"{gateway.url}/v1/chat/completions", json=body)
    plain = httpx.post(f"{engine.url}/v1/chat/completions", json=body)
    assert plain.status_code == 400 and via.status_code == plain.status_code
    assert via.json()["error"]["message"] == plain.json()["error"]["message"]
    with pytest.raises(AssertionError):  # no record for a failed request
        completions.wait_for(of_request(via.headers["x-request-id"]), timeout=1)


# -- failures of the parts around it ------------------------------------------------------------------

def test_two_upstreams_one_stopped(broker, engine, relay, base_model, completions):
    """Two upstreams, the first a plain vLLM (stopped half way), the second the session's. The plain one is the
    session's engine behind a relay that has no capture probe (``/streamrl/capture`` 404, as on a plain vLLM), so
    the gateway takes its tokens from vLLM's JSON; stopping it closes the relay (connections refused and dropped,
    as when the server exits). A real plain vLLM is started in tests/integration/test_packaged_models.py."""
    relay.not_found = (PROBE_PATH,)
    second = relay
    # the second engine first: with equal load it is picked first, so stopping it exercises the retry
    config = GatewayConfig(upstreams=(second.url, engine.url),
                           kafka=GatewayKafka(bootstrap_servers=broker.bootstrap_servers, topic_prefix=TOPICS.prefix),
                           port=free_port(), health_interval_s=60, follow_policy=False)
    with GatewayServer(config) as gw:
        health = httpx.get(f"{gw.url}/health").json()
        assert [u["token_capture"] for u in health["upstreams"]] == ["json", "engine, deferred"]  # found at start-up
        oai = client(gw)
        ids = []
        for _ in range(4):
            r = oai.chat.completions.with_raw_response.create(model=base_model, messages=CHAT, max_tokens=4)
            ids.append(r.headers["x-request-id"])
        recs = completions.wait_for(lambda r: isinstance(r, CompletionRecord) and r.request_id in ids, count=4)
        assert {r.upstream for r in recs} == {second.url, engine.url}  # both served and recorded
        assert all(0 < len(r.completion_token_ids) == len(r.logprobs) for r in recs)

        second.close()
        for _ in range(4):
            r = oai.chat.completions.with_raw_response.create(model=base_model, messages=CHAT, max_tokens=4)
            assert r.http_response.status_code == 200
            rec = completions.wait_for(of_request(r.headers["x-request-id"]))[0]
            assert rec.upstream == engine.url
        health = httpx.get(f"{gw.url}/health").json()
        assert [u["healthy"] for u in health["upstreams"]] == [False, True]
        metrics = httpx.get(f"{gw.url}/metrics").text
        assert "streamrl_gateway_upstream_retries_total 1.0" in metrics


def metric(gw: GatewayServer, name: str) -> float:
    for line in httpx.get(f"{gw.url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no metric {name}")


def undelivered(gw: GatewayServer) -> float:
    return metric(gw, "streamrl_gateway_records_undelivered_total")


def test_broker_stopped_requests_succeed_and_records_are_spooled(engine, base_model, tmp_path):
    """Kafka gone: calls still succeed and their records wait in the spool, none counted undelivered
    (delivery once the broker is back: tests/integration/test_gateway_spool.py)."""
    own = EmbeddedBroker(topics=Topics("down")).start()
    try:
        config = GatewayConfig(upstreams=(engine.url,),
                               kafka=GatewayKafka(bootstrap_servers=own.bootstrap_servers, topic_prefix="down"),
                               port=free_port(), producer_send_timeout_ms=1000, follow_policy=False,
                               spool_dir=str(tmp_path), spool_after_ms=300)
        with GatewayServer(config) as gw:
            oai = client(gw)
            oai.chat.completions.create(model=base_model, messages=CHAT, max_tokens=4)
            deadline = time.monotonic() + 30
            while gw.gateway.producer.stats.delivered < 1:
                assert time.monotonic() < deadline, "first record never delivered"
                time.sleep(0.05)
            assert undelivered(gw) == 0
            own.stop()
            for _ in range(3):
                assert oai.chat.completions.create(model=base_model, messages=CHAT, max_tokens=4).choices
            deadline = time.monotonic() + 60
            while gw.gateway.producer.stats.spool_records < 3:
                assert time.monotonic() < deadline, "records not spooled"
                time.sleep(0.2)
            assert oai.chat.completions.create(model=base_model, messages=CHAT, max_tokens=4).choices
            assert undelivered(gw) == 0
            assert metric(gw, 'streamrl_gateway_spool_waiting{stream="completions"}') >= 3
    finally:
        own.stop()


def test_decode_rejects_garbage():
    with pytest.raises(RecordError):
        decode(b"not a record")
