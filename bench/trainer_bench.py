"""Trainer throughput on one GPU: optimizer steps of GRPO on LoRA (r=16, all linear layers) over
packed 4k-token sequences, for random-initialised models of real shapes, against a plain
transformers + peft step measured in the same run.

    python bench/trainer_bench.py --shapes qwen2.5-1.5b,qwen2.5-7b --out trainer_bench.json

FLOPs per token (reported both ways):
* ``4N``: LoRA training runs the frozen weights forward (2N) and backward for activation gradients
  only (2N); no weight gradients for them. N = every matmul weight (attention, MLP, lm_head), with the
  LoRA matmuls themselves (< 1%) not counted.
* ``6N``: the usual full-training convention, for comparison with published MFU figures.
* both plus causal attention: 2 * hidden * T forward per token per layer (QK^T and AV over T/2 keys on
  average), times 3 for forward + backward.
MFU is against 989 TFLOP/s (H100/H200 dense bf16). Every token but the first of each sequence is a
trained (sampled) token in both paths, so both do the same work.

Runs without the package installed (the GPU image has no Kafka client): the repository's folders are
mapped onto the ``streamrl`` namespace below, and nothing here imports the Kafka side.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
try:
    import streamrl.trainer
except ImportError:  # not installed: map the repository's folders (streamrl.trainer -> trainer/)
    sys.path.insert(0, str(ROOT))
    import streamrl

    streamrl.__path__.append(str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from streamrl.tiny_model import SHAPES  # noqa: E402
from streamrl.trainer.config import TrainerConfig  # noqa: E402
from streamrl.trainer.learner import Learner  # noqa: E402
from streamrl.trainer.model import attach_lora  # noqa: E402

PEAK = 989e12
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build(shape: str, device: torch.device, dtype: torch.dtype, attn: str = "sdpa"):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    dims = dict(SHAPES[shape])
    config = Qwen2Config(**dims, tie_word_embeddings=False, max_position_embeddings=32768,
                         attn_implementation=attn, use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        torch.set_default_dtype(dtype)
        model = Qwen2ForCausalLM(config)
        torch.set_default_dtype(torch.float32)
    return model


def flops_per_token(model, seq_len: int) -> dict[str, float]:
    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    c = model.config
    attention = 3 * 2 * c.hidden_size * seq_len * c.num_hidden_layers
    return {"N": n, "4N+attn": 4 * n + attention, "6N+attn": 6 * n + attention}


def timed(step, warmup: int, steps: int, device: torch.device) -> float:
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def baseline(model, seq_len: int, warmup: int, steps: int, device: torch.device) -> tuple[float, object]:
    """The plain way: peft LoRA, model(input_ids, labels=input_ids), backward, AdamW; one sequence."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=list(TARGETS)))
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-4)
    x = torch.randint(0, model.config.vocab_size, (1, seq_len), device=device)

    def step() -> None:
        peft_model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    seconds = timed(step, warmup, steps, device)
    return seq_len / seconds, peft_model.unload()


def ours(model, seq_len: int, n_seqs: int, rows: int, warmup: int, steps: int, device: torch.device,
         compile_: bool, recompute: bool, profile: bool = False) -> float:
    """The trainer's own step (trainer.learner.Learner): packed rows, target-only chunked logprobs,
    GRPO loss with truncated IS, AdamW, gradient clipping."""
    config = TrainerConfig(model="bench", lora_rank=16, lora_alpha=32, target_modules=TARGETS,
                           micro_batch_tokens=rows * seq_len, row_tokens=seq_len, compile=compile_,
                           recompute_logits=recompute, logit_chunk_tokens=8192, learning_rate=1e-4)
    peft_model = attach_lora(model, config)
    learner = Learner(peft_model, config, device)
    rng = np.random.default_rng(0)
    seqs = [{"token_ids": rng.integers(0, model.config.vocab_size, seq_len), "loss_mask": np.ones(seq_len, bool),
             "behaviour_logprobs": np.full(seq_len, -12.0, np.float32), "advantage": float(rng.choice([-1, 1]))}
            for _ in range(n_seqs)]
    seconds = timed(lambda: learner.step(seqs), warmup, steps, device)
    if profile:  # one more step under the profiler: where the GPU time goes, top kernels
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            learner.step(seqs)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60), flush=True)
    peft_model.unload()
    return n_seqs * seq_len / seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qwen2.5-1.5b")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--seqs-per-step", type=int, default=8)
    p.add_argument("--rows", default="4", help="rows (4k sequences) per micro-batch, per shape: e.g. 4,2")
    p.add_argument("--variants", default="eager,compile", help="eager, eager-recompute, compile")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None)
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--profile", action="store_true", help="print the top CUDA kernels of one step per variant")
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    results = {"device": gpu, "torch": torch.__version__, "seq_len": args.seq_len, "runs": []}
    rows_per_shape = [int(r) for r in args.rows.split(",")]
    for i, shape in enumerate(args.shapes.split(",")):
        model = build(shape, device, dtype)
        fpt = flops_per_token(model, args.seq_len)
        rows = rows_per_shape[min(i, len(rows_per_shape) - 1)]

        def report(name: str, tps: float, shape=shape, fpt=fpt, rows=rows) -> None:
            mem = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
            run = {"shape": shape, "path": name, "tokens_per_s": tps, "mfu_4N": tps * fpt["4N+attn"] / PEAK,
                   "mfu_6N": tps * fpt["6N+attn"] / PEAK, "rows": rows, "max_mem_gib": mem}
            results["runs"].append(run)
            print(json.dumps(run), flush=True)
            if args.out:  # after every run, so a time-out keeps what was measured
                Path(args.out).write_text(json.dumps(results, indent=1))
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()

        print(f"{shape}: N = {fpt['N'] / 1e9:.3f}B matmul params, {fpt['4N+attn'] / 1e9:.2f} GFLOP/token (4N+attn)",
              flush=True)
        base_tps = float("nan")
        if not args.no_baseline:
            base_tps, model = baseline(model, args.seq_len, args.warmup, args.steps, device)
            report("baseline transformers+peft, 1 seq", base_tps)
        for variant in args.variants.split(","):
            try:
                tps = ours(model, args.seq_len, args.seqs_per_step, rows, args.warmup, args.steps, device,
                           compile_=variant == "compile", recompute=variant == "eager-recompute",
                           profile=args.profile)
                report(f"streamrl trainer ({variant})", tps)
                print(f"  speed-up vs baseline: {tps / base_tps:.2f}x", flush=True)
            except Exception as exc:  # report and go on: one failed variant must not lose the others
                print(f"{shape} {variant} failed: {type(exc).__name__}: {exc}", flush=True)
                torch.cuda.empty_cache() if device.type == "cuda" else None
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
