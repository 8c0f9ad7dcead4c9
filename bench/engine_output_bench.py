"""What a step's logprobs cost between vLLM's engine core and its API server, in the forms they can travel.

vLLM's engine core sends each step's outputs (one ``EngineCoreOutput`` per running request) to the API
server with its own msgpack encoder. This bench builds one step of ``--requests`` outputs of one new token
each, encodes them with vLLM's ``MsgpackEncoder`` and decodes them with its ``MsgpackDecoder``, in three
forms, and reports microseconds per request and step for each stage:

  plain   no logprobs (what plain chat sends)
  arrays  vLLM's own form for a request with ``logprobs``: a ``LogprobsLists`` of three numpy arrays,
          sliced from the step's batch (``slice_request``), each array handled by a Python hook
  floats  streamrl's ``capture_scheduler`` form: the sampled token's logprob as a float list in
          ``kv_transfer_params`` (msgpack-native, no hook)

Runs on the CPU with whichever vLLM is installed; no model, no GPU.

    .venv/bin/python bench/engine_output_bench.py [--requests 256 --steps 300] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def step_outputs(form: str, requests: int, batch: Any) -> Any:
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs

    from streamrl.vllm_capture_scheduler import LOGPROBS_KEY

    outputs = []
    for i in range(requests):
        out = EngineCoreOutput(request_id=f"chatcmpl-{i:032x}-0", new_token_ids=[1000 + i])
        if form == "arrays":
            out.new_logprobs = batch.slice_request(i, 1)
        elif form == "floats":
            out.kv_transfer_params = {LOGPROBS_KEY: batch.slice_request(i, 1).logprobs[:, 0].tolist()}
        outputs.append(out)
    return EngineCoreOutputs(outputs=outputs)


def measure(form: str, requests: int, steps: int) -> dict[str, float]:
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.outputs import LogprobsLists
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    rng = np.random.default_rng(0)
    batch = LogprobsLists(rng.integers(0, 150_000, (requests, 1), dtype=np.int32),
                          -rng.random((requests, 1), dtype=np.float32), np.ones(requests, np.int32))
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    build = encode = decode = 0.0
    size = 0
    for _ in range(steps):
        t0 = time.perf_counter()
        outputs = step_outputs(form, requests, batch)
        t1 = time.perf_counter()
        frames = encoder.encode(outputs)
        t2 = time.perf_counter()
        decoder.decode(frames)
        t3 = time.perf_counter()
        build, encode, decode = build + t1 - t0, encode + t2 - t1, decode + t3 - t2
        size = sum(len(f) for f in frames)
    per = 1e6 / (steps * requests)
    return {"build_us": build * per, "encode_us": encode * per, "decode_us": decode * per,
            "engine_core_us": (build + encode) * per, "api_server_us": decode * per, "bytes_per_request": size / requests}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    import vllm

    results: dict[str, Any] = {"vllm": vllm.__version__, "machine": f"{platform.machine()}, {platform.python_version()}",
                               "requests": args.requests, "forms": {}}
    for form in ("plain", "arrays", "floats"):
        measure(form, args.requests, 20)  # warm-up
        results["forms"][form] = measure(form, args.requests, args.steps)
    plain = results["forms"]["plain"]
    print(f"vLLM {vllm.__version__}, {args.requests} requests per step, microseconds per request and step")
    print("| form | engine core: build + encode | API server: decode | bytes | extra over plain (core / server) |")
    print("| --- | ---: | ---: | ---: | --- |")
    for form, r in results["forms"].items():
        print(f"| {form} | {r['engine_core_us']:.2f} | {r['api_server_us']:.2f} | {r['bytes_per_request']:.0f} | "
              f"{r['engine_core_us'] - plain['engine_core_us']:+.2f} / {r['api_server_us'] - plain['api_server_us']:+.2f} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
