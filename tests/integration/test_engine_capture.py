"""Token capture in the engine (``engine/capture.py``) and its wire format (``engine/wire.py``):
the real vLLM CPU server with the middleware, directly and through the gateway (the format and the hooks
on their own: ``tests/unit/test_engine_wire.py``)."""

from __future__ import annotations

import re
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import torch
from support.gateway_calls import client, direct, of_request
from support.services import start_gateway

from streamrl.broker.schema import CompletionRecord
from streamrl.engine.server import Engine
from streamrl.engine.wire import (
    CAPTURE_HEADER,
    FORMAT_VERSION,
    PROBE_PATH,
    capture_counts,
    unframe,
)


@pytest.fixture(scope="module", params=["deferred", "framed"])
def engine_gateway(broker, engine: Engine, request: pytest.FixtureRequest):
    """This module's tests through both of the engine's paths: non-streamed calls' captures on the engine's
    capture stream (deferred, the default), or framed in the answer (``--no-deferred-capture``)."""
    gw = start_gateway(broker, engine, token_capture=True, deferred_capture=request.param == "deferred")
    yield gw
    gw.stop()


# -- the real vLLM CPU server with the middleware --------------------------------------------------------


CHAT = [{"role": "user", "content": "Count with me: one, two"}]
_VOLATILE = re.compile(rb'"(id|created)":("[^"]*"|\d+)')


def normalised(raw: bytes) -> Any:
    """What two calls of the same seeded request share: a body's bytes with what differs between calls
    (the request id, the creation time) blanked. A stream is compared by what its events say, per choice:
    the text (or chat delta) joined, and every other field's last value; then the events without choices
    (usage) and ``[DONE]``, in order. Not its events one by one: with ``n`` > 1 how the choices' chunks
    interleave depends on the engine's steps, and a client that reads behind the engine gets several
    steps' deltas in one event (vLLM merges them), both differing from call to call."""
    raw = _VOLATILE.sub(rb'"\1":0', raw)
    if not raw.startswith(b"data: "):
        return raw
    choices: dict[int, dict[str, Any]] = {}
    rest: list[Any] = []
    for event in raw.split(b"\n\n"):
        if not event:
            continue
        assert event.startswith(b"data: "), event
        if event == b"data: [DONE]":
            rest.append("[DONE]")
            continue
        chunk = orjson.loads(event[6:])
        if not chunk.get("choices"):
            rest.append(chunk)
            continue
        top = {k: v for k, v in chunk.items() if k != "choices"}
        for c in chunk["choices"]:
            seen = choices.setdefault(c["index"], {"text": "", "role": None, **top})
            delta = c.get("delta") or {}
            seen["text"] += c.get("text") or delta.get("content") or ""
            seen["role"] = delta.get("role") or seen["role"]
            seen |= {k: v for k, v in c.items() if k not in ("text", "delta") and v is not None}
    return choices, rest


def test_probe_answers_the_format(engine: Engine) -> None:
    r = httpx.get(f"{engine.url}{PROBE_PATH}")
    assert r.status_code == 200 and r.json()["format"] == FORMAT_VERSION


def _logprob_steps(engine: Engine) -> dict[str, int]:
    return httpx.get(f"{engine.url}{PROBE_PATH}").json()["logprob_steps"]


def test_engine_core_sends_the_gateways_logprobs_as_a_column(engine_gateway, engine, base_model, completions):
    """The engine core's ``capture_scheduler`` sends a captured request's logprobs in its step's column, not
    vLLM's per-request numpy arrays (``engine/capture_scheduler.py``): every step of a gateway call is
    cut from a column;
    a client that asks for logprobs itself still gets vLLM's arrays, and they are what is logged."""
    before = _logprob_steps(engine)
    r = client(engine_gateway).chat.completions.with_raw_response.create(
        model=base_model, messages=CHAT, max_tokens=16, temperature=1.0, seed=5, n=2)
    recs = completions.wait_for(of_request(r.headers["x-request-id"]), count=2)
    after = _logprob_steps(engine)
    tokens = sum(len(rec.completion_token_ids) for rec in recs)
    assert after["column"] - before["column"] == tokens and after["arrays"] == before["arrays"]
    httpx.post(f"{engine_gateway.url}/v1/completions", timeout=60,
               json={"model": base_model, "prompt": "one", "max_tokens": 5, "logprobs": 1, "seed": 4})
    assert _logprob_steps(engine)["arrays"] > after["arrays"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_client_bytes_equal_vllms_for_the_plain_request(engine_gateway, engine, base_model, endpoint, stream):
    """The engine_gateway's answer is byte for byte what vLLM sends for the client's own request (ids and times
    aside), and the engine's framed answer carries those same bytes; with ``n`` = 2 it carries both choices.

    Byte for byte needs the three calls to sample the same tokens, so they have one choice each: with ``n`` = 2
    vLLM hands the engine the two choices one after the other, and whether they are prefilled in one step or
    two depends on timing and can change the CPU build's bf16 numerics, so a seeded request may sample
    otherwise from one call to the next (a CI run once had the framed call's choices differ from the plain
    call's, with the gateway's equal to it)."""
    path = "chat/completions" if endpoint == "chat" else "completions"
    body: dict[str, Any] = {"model": base_model, "max_tokens": 24, "temperature": 0.9, "seed": 11, "stream": stream}
    body |= {"messages": CHAT} if endpoint == "chat" else {"prompt": "one, two"}
    via = httpx.post(f"{engine_gateway.url}/v1/{path}", json=body, timeout=60)
    plain = httpx.post(f"{engine.url}/v1/{path}", json=body, timeout=60)
    assert via.status_code == plain.status_code == 200
    assert CAPTURE_HEADER.lower() not in via.headers
    assert normalised(via.content) == normalised(plain.content)
    framed = httpx.post(f"{engine.url}/v1/{path}", json=body, headers={CAPTURE_HEADER: "1"}, timeout=60)
    assert framed.headers[CAPTURE_HEADER] == "1"
    client_bytes, capture = unframe(framed.content)
    assert normalised(client_bytes) == normalised(plain.content) and capture is not None
    assert capture_counts(capture)[0] == 1

    two = httpx.post(f"{engine.url}/v1/{path}", json=body | {"n": 2}, headers={CAPTURE_HEADER: "1"}, timeout=60)
    client_bytes, capture = unframe(two.content)
    assert two.headers[CAPTURE_HEADER] == "1" and capture is not None and capture_counts(capture)[0] == 2
    answer = normalised(client_bytes)
    if stream:  # both choices' text, then [DONE]
        choices, rest = answer
        assert sorted(choices) == [0, 1] and rest[-1] == "[DONE]"
        assert all(c["text"] and c["finish_reason"] == "length" for c in choices.values())
    else:
        assert sorted(c["index"] for c in orjson.loads(answer)["choices"]) == [0, 1]


def test_stop_string_and_multi_prompt_batch_records_equal_vllms(engine_gateway, engine, base_model, completions):
    """A stop string ends a choice inside the engine's step (vLLM trims the step's tokens) and a batch of
    prompts numbers its choices prompt by prompt: the records follow vLLM's own token ids exactly."""
    body = {"model": base_model, "prompt": ["one, two", "three four five"], "max_tokens": 30, "n": 2,
            "temperature": 1.0, "seed": 3, "stop": ["e", " t"]}
    r = httpx.post(f"{engine_gateway.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200
    recs = completions.wait_for(of_request(r.headers["x-request-id"]), count=4)
    exact = direct(engine, "completions", body | {"logprobs": 0, "return_token_ids": True})
    assert sorted(rec.choice_index for rec in recs) == [0, 1, 2, 3]
    by_index = {rec.choice_index: rec for rec in recs}
    for choice in exact["choices"]:
        rec = by_index[choice["index"]]
        assert rec.completion_token_ids.tolist() == choice["token_ids"]
        assert rec.prompt_token_ids.tolist() == choice["prompt_token_ids"]
        np.testing.assert_array_equal(rec.logprobs, np.asarray(choice["logprobs"]["token_logprobs"], np.float32))
        assert rec.response_text == choice["text"] and rec.finish_reason == choice["finish_reason"]
    assert any(c["finish_reason"] == "stop" for c in exact["choices"])  # the stop strings did end choices


def test_client_asking_for_logprobs_gets_vllms_and_the_record_equals_them(engine_gateway, base_model, completions):
    r = httpx.post(f"{engine_gateway.url}/v1/completions", timeout=60,
                   json={"model": base_model, "prompt": "one", "max_tokens": 12, "logprobs": 2, "seed": 4,
                         "return_token_ids": True})
    choice = r.json()["choices"][0]
    assert len(choice["logprobs"]["top_logprobs"][0]) >= 2  # vLLM's own logprob objects, as asked
    rec = completions.wait_for(of_request(r.headers["x-request-id"]))[0]
    assert rec.completion_token_ids.tolist() == choice["token_ids"]
    np.testing.assert_array_equal(rec.logprobs, np.asarray(choice["logprobs"]["token_logprobs"], np.float32))


def test_streamed_request_with_tools_is_recorded(engine_gateway, base_model, completions):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}}}}}]
    with client(engine_gateway).chat.completions.with_streaming_response.create(
            model=base_model, messages=CHAT, tools=tools, max_tokens=20, stream=True, seed=9) as raw:
        request_id = raw.headers["x-request-id"]
        chunks = list(raw.parse())
    rec = completions.wait_for(of_request(request_id))[0]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert rec.response_text == text and 0 < len(rec.completion_token_ids) == len(rec.logprobs)
    assert rec.ttft_s is not None and 0 < rec.ttft_s <= rec.total_s


def test_logged_logprobs_are_the_sampling_distributions(engine_gateway, tiny_model, base_model, completions):
    """At temperature 0.7 the logged logprobs are those of softmax(logits / 0.7) (vLLM's
    ``processed_logprobs``), which the trainer recomputes for the ratio. Tolerance: vLLM's CPU build runs
    the model in bf16 and the trainer recomputes in fp32 here, so each token may differ by up to 1e-2 nats
    and on average by under 2e-3; at temperature 1 they differ by far more."""
    from streamrl.trainer.config import TrainerConfig
    from streamrl.trainer.model import load_policy, packed_logprobs

    r = client(engine_gateway).chat.completions.with_raw_response.create(
        model=base_model, messages=CHAT, max_tokens=40, temperature=0.7, seed=21)
    rec: CompletionRecord = completions.wait_for(of_request(r.headers["x-request-id"]))[0]
    model = load_policy(TrainerConfig(model=str(tiny_model), device="cpu"), torch.device("cpu"))
    ids = np.concatenate([rec.prompt_token_ids, rec.completion_token_ids])
    n_prompt = len(rec.prompt_token_ids)
    with torch.no_grad():
        recomputed = packed_logprobs(model, torch.as_tensor(ids[None], dtype=torch.long),
                                     torch.arange(len(ids))[None], torch.arange(n_prompt, len(ids)),
                                     temperatures=torch.full((len(ids) - n_prompt,), 0.7))
    logged = torch.as_tensor(rec.logprobs.copy())
    assert len(logged) > 10
    diff = (logged - recomputed).abs()
    assert diff.max() < 1e-2 and diff.mean() < 2e-3, (diff.max(), diff.mean())
    with torch.no_grad():
        at_one = packed_logprobs(model, torch.as_tensor(ids[None], dtype=torch.long), torch.arange(len(ids))[None],
                                 torch.arange(n_prompt, len(ids)))
    assert (logged - at_one).abs().max() > 0.05  # not the raw (temperature 1) distribution's
