"""Token capture in the engine (``streamrl/vllm_capture.py``) and its wire format (``streamrl/engine_wire.py``):
the format on its own, then the real vLLM CPU server with the middleware, directly and through the gateway."""

from __future__ import annotations

import random
import re
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
import torch
from conftest import start_gateway
from test_gateway import client, direct, of_request

from streamrl.broker.schema import CompletionRecord
from streamrl.engine import Engine
from streamrl.engine_wire import (
    BODY,
    CAPTURE,
    CAPTURE_HEADER,
    FORMAT_VERSION,
    PROBE_PATH,
    FrameSplitter,
    WireError,
    capture_counts,
    decode_capture,
    encode_capture,
    frame,
    unframe,
)
from streamrl.gateway.capture import (
    CallContext,
    CaptureError,
    encode_engine_parts,
    encode_engine_records,
    engine_parts,
)
from streamrl.vllm_capture import _CURRENT, _Capture, _OutputProcessorHooks
from streamrl.vllm_capture_scheduler import TESTED_VERSIONS, version_ok


@pytest.fixture(scope="module", params=["deferred", "framed"])
def engine_gateway(broker, engine: Engine, request: pytest.FixtureRequest):
    """This module's tests through both of the engine's paths: non-streamed calls' captures on the engine's
    capture stream (deferred, the default), or framed in the answer (``--no-deferred-capture``)."""
    gw = start_gateway(broker, engine, token_capture=True, deferred_capture=request.param == "deferred")
    yield gw
    gw.stop()


# -- the wire format on its own ------------------------------------------------------------------------


def _payload(rng: random.Random) -> tuple[bytes, list[tuple[int, int, np.ndarray, np.ndarray]], list[np.ndarray]]:
    prompts = [np.array([rng.randrange(150_000) for _ in range(rng.randrange(0, 40))], np.int32) for _ in range(2)]
    choices = []
    for index in range(rng.randrange(1, 5)):
        n = rng.randrange(0, 30)
        choices.append((index, index % 2, np.array([rng.randrange(150_000) for _ in range(n)], np.int32),
                        np.array([-rng.random() * 9 for _ in range(n)], np.float32)))
    return encode_capture(prompts, choices), choices, prompts


def test_capture_payload_round_trips_and_counts() -> None:
    rng = random.Random(0)
    for _ in range(50):
        raw, choices, prompts = _payload(rng)
        decoded = decode_capture(raw)
        assert [c.index for c in decoded] == [c[0] for c in choices]
        for got, (_, slot, ids, logprobs) in zip(decoded, choices, strict=True):
            assert got.prompt_token_ids.tolist() == prompts[slot].tolist()
            assert got.token_ids.tolist() == ids.tolist()
            np.testing.assert_array_equal(got.logprobs, logprobs)
        assert capture_counts(raw) == (len(choices), sum(len(p) for p in prompts), sum(len(c[2]) for c in choices))
        assert len(raw) - 9 - 4 * len(prompts) - 4 * sum(len(p) for p in prompts) - 12 * len(choices) == 8 * sum(
            len(c[2]) for c in choices)  # 8 bytes per sampled token, nothing else grows with the reply


def test_malformed_capture_is_a_wire_error() -> None:
    raw, _, _ = _payload(random.Random(1))
    for bad in (b"", bytes([FORMAT_VERSION + 1]) + raw[1:], raw[:-1], raw + b"\0", raw[:7]):
        with pytest.raises(WireError):
            decode_capture(bad)
        with pytest.raises(WireError):
            capture_counts(bad)
    with pytest.raises(WireError):
        encode_capture([np.zeros(1, np.int32)], [(0, 0, np.zeros(2, np.int32), np.zeros(1, np.float32))])


def test_frames_split_at_any_chunk_boundary() -> None:
    rng = random.Random(2)
    frames = [(BODY, b"data: " + bytes(rng.randrange(256) for _ in range(rng.randrange(0, 300))) + b"\n\n")
              for _ in range(20)]
    frames.insert(15, (CAPTURE, _payload(rng)[0]))
    wire = b"".join(frame(k, p) for k, p in frames)
    for _ in range(20):
        splitter, got, pos = FrameSplitter(), [], 0
        while pos < len(wire):
            step = rng.randrange(1, 64)
            got += splitter.feed(wire[pos:pos + step])
            pos += step
        assert got == frames and splitter.pending == 0
    body, capture = unframe(wire)
    assert body == b"".join(p for k, p in frames if k == BODY) and capture == frames[15][1]
    with pytest.raises(WireError):
        unframe(wire[:-3])
    with pytest.raises(WireError):
        FrameSplitter().feed(b"X\0\0\0\0")


def test_only_tested_vllm_versions_are_hooked() -> None:
    for version in TESTED_VERSIONS:
        assert version_ok(version) and version_ok(version + "+cpu")
    assert not version_ok("0.33.0") and not version_ok("0.26.01")


class _Processor:
    """What vLLM's ``OutputProcessor`` does to the outputs it is handed, reduced to what capture relies on: it
    trims a step's token list in place at a stop string, and extends an earlier step's list in place when a
    lagging stream reader's outputs are merged (``RequestOutput.add``), on the same list objects vLLM would
    (0.26 and 0.32). It records what it was handed, to show the capture's own fields are gone by then."""

    def __init__(self) -> None:
        self.request_states: dict[str, object] = {}
        self.held: list[int] | None = None  # the unconsumed output's token list, merged into
        self.seen_params: list[Any] = []

    def add_request(self, request, prompt, parent_req=None, request_index=0, queue=None) -> None:
        self.request_states[request.request_id] = request

    def process_outputs(self, outputs, *args, **kwargs) -> None:
        for out in outputs:
            self.seen_params.append(out.kv_transfer_params)
            if getattr(out, "stop_at", None) is not None:  # a stop string: the step's list trimmed in place
                del out.new_token_ids[out.stop_at:]
                self.request_states.pop(out.request_id)
            if self.held is None:
                self.held = out.new_token_ids
            else:  # the reader lags: the held output's list is extended in place
                self.held.extend(out.new_token_ids)


def _captured(hooks: Any, request_ids: list[str]) -> _Capture:
    """The API server half's view of one gateway call whose engine requests are ``request_ids``."""
    from types import SimpleNamespace

    capture = _Capture("chat")
    token = _CURRENT.set(capture)
    try:
        for i, r in enumerate(request_ids):
            params = SimpleNamespace(logprobs=None, extra_args=None)
            hooks.add_request(SimpleNamespace(request_id=r, external_req_id="call", sampling_params=params,
                                              prompt_token_ids=[1, 2]), None, request_index=i)
    finally:
        _CURRENT.reset(token)
    return capture


@pytest.mark.parametrize("client_logprobs", [False, True])
@pytest.mark.parametrize("speculative", [False, True])
def test_marked_logprobs_reach_the_capture_as_vllm_would_slice_them(client_logprobs: bool, speculative: bool) -> None:
    """Both halves, with vLLM's own msgpack encoder and decoder between them: when only marked requests want
    logprobs the scheduler hands vLLM's loop the step without them and sends the step's column once, on the
    first output of the message; the API server half, handed the message in chunks as vLLM's output handler
    does, cuts each marked request's logprobs from it. They must be what vLLM's own per-request slice would
    have given (``req_id_to_index``, ``cu_num_generated_tokens``, the output's tokens after stop handling),
    and the column must not reach vLLM's output processor. A step where a client's own logprobs ride along
    keeps vLLM's slices, for that client and for the capture. The base scheduler stands in for vLLM's loop
    (it slices exactly as ``Scheduler.update_from_output`` does, 0.26 and 0.32); the real engine runs in the
    tests below."""
    from types import SimpleNamespace

    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.outputs import LogprobsLists
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from streamrl.vllm_capture_scheduler import MARK, STEP_KEY, _CaptureMixin

    kept = {"a": 1, "b": 2, "c": 0, "d": 2}  # tokens each request keeps this step ("c": none, stopped)
    generated = {"a": 1, "b": 3, "c": 1, "d": 2} if speculative else {r: 1 for r in kept}
    if not speculative:
        kept = {"a": 1, "b": 1, "c": 0, "d": 1}
    order = ["b", "a", "d", "c"]  # the batch's rows are not in request order
    cu = np.cumsum([0] + [generated[r] for r in order]).tolist()
    rows = cu[-1]
    batch = LogprobsLists(np.arange(rows * 2).reshape(rows, 2),
                          -np.arange(rows * 2, dtype=np.float32).reshape(rows, 2) / 7,
                          np.zeros(rows, np.int64), cu[:-1] if speculative else None)
    marked = ["a", "b", "c"]
    own = {"d"} if client_logprobs else set()

    def request(r: str) -> SimpleNamespace:
        wants = r in marked or r in own
        params = SimpleNamespace(logprobs=0 if wants else None, extra_args={MARK: True} if r in marked else None)
        return SimpleNamespace(request_id=r, sampling_params=params)

    class VllmLoop:  # vLLM's loop, reduced to what touches logprobs
        def __init__(self) -> None:
            self.requests: dict[str, SimpleNamespace] = {}

        def add_request(self, req: SimpleNamespace) -> None:
            self.requests[req.request_id] = req

        def update_from_output(self, scheduler_output, runner):
            out = []
            for r in scheduler_output.num_scheduled_tokens:
                i = runner.req_id_to_index[r]
                tokens = list(range(kept[r]))
                lp = None
                if self.requests[r].sampling_params.logprobs is not None and runner.logprobs:
                    lp = runner.logprobs.slice_request(i, len(tokens))
                out.append(EngineCoreOutput(request_id=r, new_token_ids=tokens, new_logprobs=lp))
            return {0: EngineCoreOutputs(outputs=out)}

    class Capture(_CaptureMixin, VllmLoop):
        pass

    step = SimpleNamespace(num_scheduled_tokens={r: generated[r] for r in ["d", "c", "b", "a"]})
    runner = SimpleNamespace(logprobs=batch, req_id_to_index={r: i for i, r in enumerate(order)})
    vllm_loop, scheduler = VllmLoop(), Capture()
    for r in order:
        vllm_loop.add_request(request(r))
        scheduler.add_request(request(r))
    want = {o.request_id: o for o in vllm_loop.update_from_output(step, runner)[0].outputs}
    message = scheduler.update_from_output(step, runner)[0]
    assert runner.logprobs is batch  # handed back as it came
    carrier = message.outputs[0].kv_transfer_params
    assert (carrier is None) == client_logprobs and (client_logprobs or STEP_KEY in carrier)

    hooks = _OutputProcessorHooks(processor := _Processor())
    capture = _captured(hooks, marked)
    received = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(message))
    for start in range(0, len(received.outputs), 3):  # vLLM's output handler: the message in chunks, in order
        hooks.process_outputs(received.outputs[start:start + 3])
    assert hooks._step is None  # the column served its message and no further
    assert processor.seen_params == [None] * 4  # nothing of the capture's reached vLLM's processor
    for choice in capture.choices:
        logprobs = choice.logprob_array()
        np.testing.assert_array_equal(logprobs, want[choice.request_id].new_logprobs.logprobs[:, 0])
        assert len(logprobs) == kept[choice.request_id]
    got_d = next(o for o in received.outputs if o.request_id == "d")
    if client_logprobs:
        np.testing.assert_array_equal(got_d.new_logprobs.logprobs, want["d"].new_logprobs.logprobs)
    else:
        assert got_d.new_logprobs is None


def test_capture_keeps_each_steps_tokens_as_vllm_left_them_after_the_step() -> None:
    """vLLM's output processor trims a step's token list in place at a stop string, and later extends an
    earlier step's list in place when a lagging stream reader's outputs are merged (``RequestOutput.add``):
    the capture must see the first and not the second. Under load the second made captures of 9 or 10
    tokens with 8 logprobs, which the engine then could not send. The processor is the stand-in above (the
    real engine cannot be made to lag on cue)."""
    from types import SimpleNamespace

    from streamrl.vllm_capture_scheduler import STEP_KEY

    hooks = _OutputProcessorHooks(processor := _Processor())
    capture = _captured(hooks, ["r-1"])
    steps = [([10, 11], None), ([12], None), ([13, 14, 15], 1)]  # the last step stops after its first token
    for i, (ids, stop_at) in enumerate(steps):
        column = np.full(len(ids), -0.5 - i, np.float32).tobytes()
        out = SimpleNamespace(request_id="r-1", new_token_ids=list(ids), new_logprobs=None, stop_at=stop_at,
                              kv_transfer_params={STEP_KEY: [1, {"r-1": 0}, column, [0]]})
        hooks.process_outputs([out])
    (choice,) = capture.choices
    assert [t for chunk in choice.token_chunks for t in chunk] == [10, 11, 12, 13]
    assert choice.done and capture.complete()
    assert processor.held == [10, 11, 12, 13]  # vLLM's own merge did happen, on its own lists


def test_a_call_without_capture_is_counted_not_recorded() -> None:
    ctx = CallContext(trajectory_id="t", group_id=None, endpoint="chat", model="m", policy_name=None,
                      policy_version=0, request={})
    with pytest.raises(CaptureError):
        encode_engine_records(ctx, b"{}", None, 0.1)
    body = b'{"id":"x","choices":[{"index":0,"message":{"content":"hi"},"finish_reason":"stop"}]}'
    capture = encode_capture([np.arange(3, dtype=np.int32)],
                             [(1, 0, np.arange(2, dtype=np.int32), np.zeros(2, np.float32))])
    with pytest.raises(CaptureError, match="captured"):  # the choice indices must agree
        encode_engine_records(ctx, body, capture, 0.1)
    stream = [(0.0, b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'),
              (0.1, b'data: {"error":{"message":"boom"}}\n\n')]
    with pytest.raises(CaptureError, match="error"):  # vLLM's mid-stream error: no record
        encode_engine_records(ctx, stream, capture, 0.1)


def test_a_call_handed_over_as_parts_makes_the_same_records() -> None:
    """The gateway's hand-off of a non-streamed call (context as JSON, body and capture as they came) builds
    in the producer process exactly the records that the call's objects build."""
    ctx = CallContext(trajectory_id="t-1", group_id="g", endpoint="chat", model="m", policy_name="p",
                      policy_version=3, request={"messages": [{"role": "user", "content": "héllo"}], "n": 1},
                      purpose="eval", key_id="k")
    body = b'{"id":"x","choices":[{"index":0,"message":{"content":"hi"},"finish_reason":"stop"}]}'
    capture = encode_capture([np.arange(3, dtype=np.int32)],
                             [(0, 0, np.arange(2, dtype=np.int32), np.asarray([-0.25, -1.5], np.float32))])
    records = encode_engine_records(ctx, body, capture, 0.125)
    assert encode_engine_parts(engine_parts(ctx, 0.125), body, capture) == records
    with pytest.raises(CaptureError):  # a capture that does not fit the body: no record, as for the objects
        encode_engine_parts(engine_parts(ctx, 0.125), body.replace(b'"index":0', b'"index":1'), capture)


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
    vLLM's per-request numpy arrays (``streamrl/vllm_capture_scheduler.py``): every step of a gateway call is
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
    aside), and the engine's framed answer carries those same bytes."""
    path = "chat/completions" if endpoint == "chat" else "completions"
    body: dict[str, Any] = {"model": base_model, "max_tokens": 24, "temperature": 0.9, "seed": 11, "n": 2,
                            "stream": stream}
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
    assert capture_counts(capture)[0] == 2


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
