"""What the sampled token's logprob costs vLLM's GPU sampler per decode step, and what it could cost.

For a request with ``logprobs`` set, vLLM 0.26's GPU model runner calls ``compute_topk_scores`` on the
step's processed logits (``vllm/v1/worker/gpu/sample/logprob.py``): a Triton kernel that finds each row's
max and log-sum-exp over the whole vocabulary with one program per row, and a second one that ranks the
sampled token against the whole vocabulary. Token capture needs neither the rank nor top-k, only the sampled
token's logprob. This bench times, with CUDA events, on a ``[rows, vocab]`` logits tensor of the model's dtype:

  vllm_scores        vLLM's ``compute_topk_scores(logits, 0, sampled)`` (logprob + rank: what runs today)
  vllm_logprob_only  vLLM's ``compute_token_logprobs`` alone (the same without the rank kernel)
  log_softmax_gather ``torch.log_softmax(logits, -1, dtype=float32).gather(sampled)``
  float_logsumexp    ``logits.float()``, ``logsumexp``, the sampled logit minus it
  read_once          ``logits.amax(-1)``: one read of the logits, the floor for anything that reads them all

and, for scale, the host time of launching each (what the engine core's thread spends, CUDA graphs do not
cover the sampler), and each candidate's largest difference from ``vllm_scores``' logprob. Needs a CUDA
GPU (vLLM's kernels are Triton); on a machine without one it says so and exits 0.

    python bench/sampler_logprob_bench.py [--rows 64,128,256] [--vocab 151936] [--json FILE]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def candidates() -> dict[str, Callable[[Any, Any], Any]]:
    """Each way of getting the sampled tokens' logprobs: ``fn(logits, sampled) -> float32 [rows]``."""
    import torch

    def vllm_scores(logits: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
        from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores

        return compute_topk_scores(logits, 0, sampled).logprobs[:, 0]

    def vllm_logprob_only(logits: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
        from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs

        return compute_token_logprobs(logits, sampled.unsqueeze(-1))[:, 0]

    def log_softmax_gather(logits: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits, -1, dtype=torch.float32).gather(-1, sampled.unsqueeze(-1))[:, 0]

    def float_logsumexp(logits: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
        full = logits.float()
        return full.gather(-1, sampled.unsqueeze(-1))[:, 0] - torch.logsumexp(full, -1)

    def read_once(logits: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
        return logits.amax(-1).float()

    return {f.__name__: f for f in (vllm_scores, vllm_logprob_only, log_softmax_gather, float_logsumexp, read_once)}


def time_one(fn: Callable[[], Any], iters: int) -> dict[str, float]:
    """GPU milliseconds per call (CUDA events around ``iters`` calls) and host microseconds per launch."""
    import torch

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    host = 0.0
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        host += time.perf_counter() - t
    end.record()
    torch.cuda.synchronize()
    return {"gpu_ms": start.elapsed_time(end) / iters, "host_us": host / iters * 1e6}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="64,128,256", help="requests in the step (comma-separated)")
    ap.add_argument("--vocab", type=int, default=151936, help="vocabulary (Qwen2.5's by default)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--temperature", type=float, default=0.7, help="divides the logits, as the sampler does")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("sampler_logprob_bench: no CUDA GPU here (vLLM's sampler kernels are Triton); nothing measured")
        return 0
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    fns = candidates()
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "vocab": args.vocab, "dtype": args.dtype,
                              "rows": {}}
    for rows in [int(r) for r in args.rows.split(",")]:
        logits = (torch.randn(rows, args.vocab, device="cuda") * 4 / args.temperature).to(dtype)
        sampled = torch.multinomial(torch.softmax(logits.float(), -1), 1)[:, 0]
        reference = fns["vllm_scores"](logits, sampled)
        per: dict[str, Any] = {}
        for name, fn in fns.items():
            per[name] = time_one(functools.partial(fn, logits, sampled), args.iters)
            if name != "read_once":
                per[name]["max_abs_diff"] = float((fn(logits, sampled) - reference).abs().max())
        result["rows"][rows] = per
        base = per["vllm_scores"]["gpu_ms"]
        print(f"rows {rows}: " + "  ".join(
            f"{n} {v['gpu_ms'] * 1e3:.0f} us ({v['gpu_ms'] / base:.2f}x, host {v['host_us']:.0f} us)"
            for n, v in per.items()))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
