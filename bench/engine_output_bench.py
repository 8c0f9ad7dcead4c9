"""What a step's logprobs cost between vLLM's engine core and its API server, in the forms they can travel.

vLLM's engine core sends each step's outputs (one ``EngineCoreOutput`` per running request) to the API
server with its own msgpack encoder. This bench builds one step of ``--requests`` outputs of one new token
each, encodes them with vLLM's ``MsgpackEncoder``, decodes them with its ``MsgpackDecoder`` and hands them
to streamrl's capture hooks (``engine/capture.py``, with an output processor that does nothing), in
three forms, and reports microseconds per request and step for each process:

  plain   no logprobs, nothing captured (what plain chat sends)
  arrays  vLLM's own form for a request with ``logprobs``: a ``LogprobsLists`` of three numpy arrays,
          sliced from the step's batch (``slice_request``), each array handled by a Python hook
  column  streamrl's ``capture_scheduler`` form: the step's float32 column sent once, on the first output
          (``vllm_capture_scheduler.attach_step``), each request's logprobs cut from it in the API server

The engine core's thread is what bounds generation at hundreds of requests in flight, so its column is
the one to read. Runs on the CPU with whichever vLLM is installed; no model, no GPU.

    .venv/bin/python bench/engine_output_bench.py [--requests 256 --steps 300] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from harness import stamp


def request_id(i: int) -> str:
    return f"chatcmpl-{i:032x}-0"


def step_outputs(form: str, requests: int, batch: Any, rows: dict[str, int]) -> Any:
    """One step's message to the API server, as the engine core's scheduler builds it in ``form`` (``rows``:
    the model runner's ``req_id_to_index``, which exists whatever the form)."""
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

    from streamrl.engine.capture_scheduler import attach_step

    outputs = []
    for i in range(requests):
        out = EngineCoreOutput(request_id=request_id(i), new_token_ids=[1000 + i])
        if form == "arrays":
            out.new_logprobs = batch.slice_request(i, 1)
        outputs.append(out)
    message = EngineCoreOutputs(outputs=outputs)
    if form == "column":
        attach_step({0: message}, batch, rows)
    return message


class _NullProcessor:
    """vLLM's output processor, doing nothing: what is left is the capture hooks' own work."""

    def __init__(self) -> None:
        self.request_states: dict[str, Any] = {}

    def add_request(self, request: Any, *args: Any, **kwargs: Any) -> None:
        self.request_states[request.request_id] = request

    def process_outputs(self, outputs: Any, *args: Any, **kwargs: Any) -> None:
        pass


def capture_hooks(form: str, requests: int) -> Any:
    """The API server half with one captured call per request (none for plain chat)."""
    from types import SimpleNamespace

    from streamrl.engine.capture import _CURRENT, _Capture, _OutputProcessorHooks

    hooks = _OutputProcessorHooks(_NullProcessor())
    if form == "plain":
        return hooks
    for i in range(requests):
        token = _CURRENT.set(_Capture("chat"))
        params = SimpleNamespace(logprobs=0 if form == "arrays" else None, extra_args=None)
        hooks.add_request(SimpleNamespace(request_id=request_id(i), external_req_id=None, sampling_params=params,
                                          prompt_token_ids=[1]), None)
        _CURRENT.reset(token)
    return hooks


def measure(form: str, requests: int, steps: int) -> dict[str, float]:
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.outputs import LogprobsLists
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    rng = np.random.default_rng(0)
    batch = LogprobsLists(rng.integers(0, 150_000, (requests, 1), dtype=np.int32),
                          -rng.random((requests, 1), dtype=np.float32), np.ones(requests, np.int32))
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    hooks = capture_hooks(form, requests)
    rows = {request_id(i): i for i in range(requests)}
    build = encode = decode = capture = 0.0
    size = 0
    for _ in range(steps):
        t0 = time.perf_counter()
        outputs = step_outputs(form, requests, batch, rows)
        t1 = time.perf_counter()
        frames = encoder.encode(outputs)
        t2 = time.perf_counter()
        received = decoder.decode(frames)
        t3 = time.perf_counter()
        hooks.process_outputs(received.outputs)
        t4 = time.perf_counter()
        build, encode, decode, capture = build + t1 - t0, encode + t2 - t1, decode + t3 - t2, capture + t4 - t3
        size = sum(len(f) for f in frames)
    per = 1e6 / (steps * requests)
    return {"build_us": build * per, "encode_us": encode * per, "decode_us": decode * per,
            "capture_us": capture * per, "engine_core_us": (build + encode) * per,
            "api_server_us": (decode + capture) * per, "bytes_per_request": size / requests}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    import vllm

    results: dict[str, Any] = {**stamp(), "vllm": vllm.__version__,
                               "requests": args.requests, "forms": {}}
    for form in ("plain", "arrays", "column"):
        measure(form, args.requests, 20)  # warm-up
        results["forms"][form] = measure(form, args.requests, args.steps)
    plain = results["forms"]["plain"]
    print(f"vLLM {vllm.__version__}, {args.requests} requests per step, microseconds per request and step")
    print("| form | engine core: build + encode | API server: decode + capture | bytes | extra over plain (core / server) |")
    print("| --- | ---: | ---: | ---: | --- |")
    for form, r in results["forms"].items():
        print(f"| {form} | {r['engine_core_us']:.2f} | {r['api_server_us']:.2f} | {r['bytes_per_request']:.0f} | "
              f"{r['engine_core_us'] - plain['engine_core_us']:+.2f} / {r['api_server_us'] - plain['api_server_us']:+.2f} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
