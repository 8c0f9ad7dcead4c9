"""In-flight updates' pieces on their own (``engine/inflight.py``, the capture scheduler's and the capture's
parts, capture format 2): which requests move and from which token, how the worker applies a move to both of
vLLM's model runners' state, and how the API server half turns moves into version spans. The real engine moves
a real request in tests/integration/test_inflight.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from streamrl.engine.capture import _CURRENT, _Capture, _Choice, _OutputProcessorHooks
from streamrl.engine.inflight import FOLLOW, MOVES_KEY, MovePlanner, apply_moves, served_version
from streamrl.engine.wire import (
    SPANS_FORMAT_VERSION,
    WireError,
    capture_counts,
    decode_capture,
    encode_capture,
)


def lora(name: str, int_id: int) -> SimpleNamespace:
    return SimpleNamespace(lora_name=name, lora_int_id=int_id)


def request(rid: str, name: str | None, int_id: int = 1, follow: bool = True, outputs: int = 0,
            placeholders: int = 0, client: int = 0) -> SimpleNamespace:
    params = SimpleNamespace(extra_args={FOLLOW: True} if follow else None)
    return SimpleNamespace(request_id=rid, lora_request=lora(name, int_id) if name else None, sampling_params=params,
                           output_token_ids=[7] * outputs, num_output_placeholders=placeholders,
                           client_index=client, is_finished=lambda: False)


def test_served_names_parse() -> None:
    assert served_version("policy@v12") == ("policy", 12)
    assert served_version("a@b@v3") == ("a@b", 3)
    assert served_version("policy") is None and served_version("x@v") is None and served_version(None) is None


def test_a_newer_version_moves_the_marked_requests_of_its_policy_only() -> None:
    planner = MovePlanner()
    running = {
        "a": request("a", "p@v1", 1, outputs=5),
        "b": request("b", "p@v1", 1, outputs=3, placeholders=1),  # async scheduling: one token in flight
        "pinned": request("pinned", "p@v1", 1, follow=False, outputs=4),
        "other": request("other", "q@v1", 3, outputs=2),
        "base": request("base", None, outputs=2),
    }
    for r in running.values():
        assert planner.arrived(r) is None
    assert planner.plan(running) == []  # no news: nothing looked at
    newer = request("new", "p@v2", 2)
    assert planner.arrived(newer) is None
    running["new"] = newer
    moves = {m.request_id: m for m in planner.plan(running)}
    assert set(moves) == {"a", "b"}
    assert (moves["a"].first_token, moves["a"].version) == (5, 2)
    assert moves["b"].first_token == 4  # after the token still in flight
    assert running["a"].lora_request is newer.lora_request and running["pinned"].lora_request.lora_name == "p@v1"
    assert running["other"].lora_request.lora_name == "q@v1"
    assert planner.plan(running) == [] and planner.moved == 2
    late = request("late", "p@v1", 1)  # routed to v1 by a gateway that had not swapped yet
    move = planner.arrived(late)
    assert move is not None and move.first_token == 0 and late.lora_request.lora_name == "p@v2"


def test_moves_apply_to_both_model_runners() -> None:
    new = lora("p@v2", 2)
    # model runner V1: request states and the persistent batch's LoRA mapping
    batch = SimpleNamespace(req_id_to_index={"a": 0, "c": 1}, request_lora_mapping=np.array([1, 1, 0]),
                            lora_id_to_request_ids={1: {"a", "c"}}, lora_id_to_lora_request={1: lora("p@v1", 1)})
    v1 = SimpleNamespace(requests={"a": SimpleNamespace(lora_request=lora("p@v1", 1)),
                                   "b": SimpleNamespace(lora_request=lora("p@v1", 1)),  # not in the batch
                                   "c": SimpleNamespace(lora_request=lora("p@v1", 1))},
                         input_batch=batch)
    assert apply_moves(v1, {"a": new, "b": new, "unseen": new}) == 2
    assert v1.requests["a"].lora_request is new and v1.requests["b"].lora_request is new
    assert batch.request_lora_mapping.tolist() == [2, 1, 0]
    assert batch.lora_id_to_request_ids == {1: {"c"}, 2: {"a"}} and batch.lora_id_to_lora_request[2] is new
    apply_moves(v1, {"c": new})
    assert 1 not in batch.lora_id_to_request_ids and 1 not in batch.lora_id_to_lora_request
    # model runner V2: its LoraState by request id and by row
    state = SimpleNamespace(lora_requests={"a": lora("p@v1", 1)}, lora_ids=np.array([1, 0], np.int32))
    v2 = SimpleNamespace(lora_state=state, req_states=SimpleNamespace(req_id_to_index={"a": 0}))
    assert apply_moves(v2, {"a": new, "gone": new}) == 1
    assert state.lora_requests["a"] is new and state.lora_ids.tolist() == [2, 0]


def test_moves_travel_with_the_step_to_their_api_server_and_become_spans() -> None:
    """The scheduler's half attaches each API server's moves to its first output of the step (vLLM's msgpack
    between the processes, as in the engine); the API server half turns them into the choices' spans and takes
    the key out before vLLM's output processor sees it."""
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from streamrl.engine.capture_scheduler import attach_moves
    from streamrl.engine.inflight import Move

    outputs = {0: EngineCoreOutputs(outputs=[EngineCoreOutput(request_id="r1", new_token_ids=[5])])}
    moves = [Move("r1", 0, 3, 2, lora("p@v2", 2)), Move("r9", 1, 0, 2, lora("p@v2", 2))]  # API server 1 has no output this step
    assert [m.request_id for m in attach_moves(outputs, moves)] == ["r9"]
    received = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(outputs[0]))

    class Processor:
        def __init__(self) -> None:
            self.request_states: dict[str, object] = {"r1": object()}
            self.seen: list[object] = []

        def add_request(self, *args, **kwargs) -> None:
            pass

        def process_outputs(self, outs, *args, **kwargs) -> None:
            self.seen += [o.kv_transfer_params for o in outs]

    hooks = _OutputProcessorHooks(processor := Processor())
    capture = _Capture("completions", follow=True)
    token = _CURRENT.set(capture)
    try:
        params = SimpleNamespace(logprobs=None, extra_args=None)
        hooks.add_request(SimpleNamespace(request_id="r1", external_req_id="call", sampling_params=params,
                                          prompt_token_ids=[1], lora_request=lora("p@v1", 1)), None)
    finally:
        _CURRENT.reset(token)
    assert params.extra_args[FOLLOW] is True  # marked for the engine core
    hooks.process_outputs(received.outputs)
    assert processor.seen == [None] and hooks.moves == 1 and hooks.moves_to == {"p@v2": 1}
    assert capture.choices[0].spans == [(0, 1), (3, 2)]


def test_choice_spans_follow_moves_and_cover_only_its_tokens() -> None:
    c = _Choice("r", "r", 0, [1], False, version=4)
    c.moved(0, 5)  # moved before its first token: it never ran on 4
    assert c.spans == [(0, 5)]
    c.moved(10, 6)
    c.moved(10, 7)  # two moves before the next token: the later wins
    assert c.spans == [(0, 5), (10, 7)]
    c.moved(12, 7)
    assert c.spans == [(0, 5), (10, 7)]
    assert c.version_spans(10) == [(0, 5)] and c.version_spans(11) == [(0, 5), (10, 7)]


def test_capture_format_2_carries_spans_and_format_1_does_not() -> None:
    prompts = [np.array([1, 2], np.int32)]
    ids, lps = np.arange(6, dtype=np.int32), -np.ones(6, np.float32)
    plain = encode_capture(prompts, [(0, 0, ids, lps)])
    assert plain[0] == 1 and decode_capture(plain)[0].version_spans is None
    spans = encode_capture(prompts, [(0, 0, ids, lps)], [[(0, 1), (4, 3)]])
    assert spans[0] == SPANS_FORMAT_VERSION and capture_counts(spans) == (1, 2, 6)
    (choice,) = decode_capture(spans)
    assert choice.version_spans == [(0, 1), (4, 3)]
    np.testing.assert_array_equal(choice.token_ids, ids)
    for bad in ([(1, 1)], [(0, 1), (7, 2)], [(0, 1), (4, 2), (2, 3)]):
        with pytest.raises(WireError):
            decode_capture(encode_capture(prompts, [(0, 0, ids, lps)], [bad]))


def test_moves_reach_the_worker_through_the_scheduler_output() -> None:
    """The step's moves ride on the ``SchedulerOutput`` to the worker, pickled across processes as vLLM's
    multiprocess executor sends it."""
    import pickle

    from vllm.lora.request import LoRARequest
    from vllm.v1.core.sched.output import SchedulerOutput

    output = SchedulerOutput.make_empty() if hasattr(SchedulerOutput, "make_empty") else None
    if output is None:
        pytest.skip("this vLLM has no SchedulerOutput.make_empty")
    setattr(output, MOVES_KEY, {"r": LoRARequest("p@v2", 2, "/tmp/x")})
    back = pickle.loads(pickle.dumps(output))
    assert getattr(back, MOVES_KEY)["r"].lora_name == "p@v2"


def test_the_cache_policy_rides_with_the_request_and_recompute_re_hashes_it() -> None:
    """The follow header's value becomes the request's cache policy; a ``recompute`` move makes the request's
    block hashes again under its new adapter (whatever its state), and preempts it when it runs (vLLM's own
    preemption, checked against the real engine in tests/integration/test_engine_inflight.py)."""
    from streamrl.engine.capture import follow_policy
    from streamrl.engine.inflight import KEEP, RECOMPUTE, rehash, restart

    assert (follow_policy(b"1"), follow_policy(b"recompute"), follow_policy(b"2"), follow_policy(None)) == (
        KEEP, RECOMPUTE, None, None)
    planner = MovePlanner()
    kept, redone = request("k", "p@v1", 1, outputs=4), request("r", "p@v1", 1, outputs=6)
    redone.sampling_params.extra_args = {FOLLOW: RECOMPUTE}
    for r in (kept, redone):
        planner.arrived(r)
    planner.arrived(request("new", "p@v2", 2))
    moves = {m.request_id: m for m in planner.plan({"k": kept, "r": redone})}
    assert not moves["k"].recompute and moves["r"].recompute

    hashed: list[str] = []
    waiting = SimpleNamespace(status=SimpleNamespace(name="WAITING"), output_token_ids=[7] * 6, block_hashes=["old"],
                              update_block_hashes=lambda: hashed.append(redone_lora(waiting)))

    def redone_lora(r: SimpleNamespace) -> str:
        r.block_hashes.append("new")
        return "done"

    waiting.lora_request = moves["r"].lora_request
    scheduler = SimpleNamespace(requests={"r": waiting}, running=[])
    restart(scheduler, moves["r"])  # not running: nothing to preempt, its hashes are made again
    assert waiting.block_hashes == ["new"] and hashed == ["done"] and moves["r"].first_token == 6
    rehash(waiting)
    assert waiting.block_hashes == ["new"]
