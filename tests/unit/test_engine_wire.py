"""Token capture's wire format (``engine/wire.py``) on its own, and the capture hooks of
``engine/capture.py`` fed as vLLM would feed them, without a server."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from streamrl.engine.capture import _CURRENT, _Capture, _OutputProcessorHooks
from streamrl.engine.vllm_hooks import TESTED_VERSIONS, version_ok
from streamrl.engine.wire import (
    BODY,
    CAPTURE,
    FORMAT_VERSION,
    FrameSplitter,
    WireError,
    capture_counts,
    decode_capture,
    encode_capture,
    frame,
    unframe,
)
from streamrl.gateway.recording.capture import (
    CallContext,
    CaptureError,
    encode_engine_parts,
    encode_engine_records,
    engine_parts,
)

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

    from streamrl.engine.capture_scheduler import MARK, STEP_KEY, _CaptureMixin

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

    from streamrl.engine.capture_scheduler import STEP_KEY

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
