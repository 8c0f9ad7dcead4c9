"""Trainer throughput: optimizer steps of GRPO on LoRA (r=16, all linear layers) over packed 4k-token
sequences, for random-initialised models of real shapes, against a plain transformers + peft step
measured in the same run; with ``--nproc N``, the same on N GPUs (torch.distributed) against one.

One GPU, several variants of the trainer's step in one process (the model is built once):

    python3 bench/trainer_bench.py --shapes qwen2.5-1.5b --rows 4 --warmup 2 --steps 3 \\
        --variants eager,eager:recompute,compile,compile:recompute,compile:r8 --out trainer_bench.json

A variant is ``MODE[:rN][:recompute]``:
* MODE ``eager``; ``compile`` (``TrainerConfig.compile = "dynamic"``: each decoder layer compiled, one
  graph for all layers, rows and length symbolic); ``compile-static`` (``"static"``: specialised to
  the first shapes). Eager variants always run before compiled ones: compiling is in place, on the
  one model every variant of a shape shares. The compile warm-up is excluded from the timing
  (``warmup_s`` reports it).
* ``rN``: N rows (one 4k sequence each) per micro-batch (default: ``--rows`` for the shape).
* ``recompute``: ``recompute_logits`` on (each logit chunk recomputed in the backward pass); without
  it the chunk logits are kept for the backward pass (more memory, one lm_head matmul fewer), as in
  the figures in docs/benchmarks.md.

Several GPUs (``--nproc N``): for each variant, one rank and then N ranks, each rank in a process of
its own (torch.multiprocessing spawn; NCCL on CUDA, gloo on the CPU), each running the trainer's
``Learner`` (micro-batches dealt to ranks, LoRA gradients all-reduced). Weak scaling: a step holds
``--seqs-per-step`` sequences per rank. Reported: aggregate tokens/s, per-GPU MFU and scaling
efficiency = tokens/s(N) / (N x tokens/s(1)), both measured in the same run. On a CPU-only machine
the same runs with gloo on a small shape (``--shapes tiny --seq-len 128 --device cpu``), which checks
the code path, not the speed.

FLOPs per token (reported both ways):
* ``4N``: LoRA training runs the frozen weights forward (2N) and backward for activation gradients
  only (2N); no weight gradients for them. N = every matmul weight (attention, MLP, lm_head), with the
  LoRA matmuls themselves (< 1%) not counted.
* ``6N``: the usual full-training convention, for comparison with published MFU figures.
* both plus causal attention: 2 * hidden * T forward per token per layer (QK^T and AV over T/2 keys on
  average), times 3 for forward + backward.
MFU is against 989 TFLOP/s (H100/H200 dense bf16). Every token but the first of each sequence is a
trained (sampled) token in both paths, so both do the same work.

Progress goes to stdout as one JSON line per run (flushed), and ``--out`` is rewritten after every
run, so a run cut short keeps what it measured.

Runs without the package installed (the GPU image has no Kafka client): the repository's folders are
mapped onto the ``streamrl`` namespace below, and nothing here imports the Kafka side.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
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
from streamrl.trainer.batch import Batch, sequences_batch  # noqa: E402
from streamrl.trainer.config import TrainerConfig  # noqa: E402
from streamrl.trainer.learner import Learner  # noqa: E402
from streamrl.trainer.model import attach_lora  # noqa: E402

PEAK = 989e12
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# NVLink multicast stays off on the shared GPU hosts (see the device notes); kept where already set
NCCL_SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclass(frozen=True)
class Variant:
    mode: str  # eager | compile | compile-static
    rows: int | None  # rows per micro-batch; None = the shape's --rows
    recompute: bool  # TrainerConfig.recompute_logits

    @classmethod
    def parse(cls, spec: str) -> Variant:
        mode, *opts = spec.strip().split(":")
        if mode not in ("eager", "compile", "compile-static"):
            raise ValueError(f"unknown variant mode {mode!r} in {spec!r}")
        rows, recompute = None, False
        for opt in opts:
            if opt == "recompute":
                recompute = True
            elif opt.startswith("r") and opt[1:].isdigit():
                rows = int(opt[1:])
            else:
                raise ValueError(f"unknown variant option {opt!r} in {spec!r}")
        return cls(mode, rows, recompute)

    @property
    def compile(self) -> bool | str:
        return {"eager": False, "compile": "dynamic", "compile-static": "static"}[self.mode]

    def label(self, rows: int) -> str:
        return f"{self.mode}, {rows} rows, recompute {'on' if self.recompute else 'off'}"


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step, warmup: int, steps: int, device: torch.device) -> tuple[float, float]:
    """(seconds per timed step, seconds of the warm-up steps: compilation included)."""
    start = time.perf_counter()
    for _ in range(warmup):
        step()
    _sync(device)
    warm = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return (time.perf_counter() - start) / steps, warm


def peak_gib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def baseline(model, seq_len: int, warmup: int, steps: int, device: torch.device) -> float:
    """The plain way: peft LoRA, model(input_ids, labels=input_ids), backward, AdamW; one sequence."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=list(TARGETS)))
    try:
        opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-4)
        x = torch.randint(0, model.config.vocab_size, (1, seq_len), device=device)

        def step() -> None:
            peft_model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        seconds, _ = timed(step, warmup, steps, device)
        return seq_len / seconds
    finally:
        peft_model.unload()


def sequences(n: int, seq_len: int, vocab: int) -> Batch:
    """A step's batch of ``n`` fully sampled sequences (the trainer's Arrow batch)."""
    rng = np.random.default_rng(0)
    return Batch.of(sequences_batch([rng.integers(0, vocab, seq_len).astype(np.int32) for _ in range(n)],
                                    [np.ones(seq_len, np.int8) for _ in range(n)],
                                    behaviour_logprobs=[np.full(seq_len, -12.0, np.float32) for _ in range(n)],
                                    advantage=[float(rng.choice([-1, 1])) for _ in range(n)]))


def ours(model, variant: Variant, rows: int, seq_len: int, n_seqs: int, warmup: int, steps: int,
         device: torch.device, profile: bool = False) -> tuple[float, float]:
    """The trainer's own step (trainer.learner.Learner): packed rows, target-only chunked logprobs,
    GRPO loss with truncated IS, AdamW, gradient clipping. ``n_seqs`` sequences per step (all ranks
    together under torch.distributed). Returns (seconds per step, warm-up seconds)."""
    config = TrainerConfig.load(None, model="bench", lora_rank=16, lora_alpha=32, target_modules=TARGETS,
                           micro_batch_tokens=rows * seq_len, row_tokens=seq_len, compile=variant.compile,
                           recompute_logits=variant.recompute, logit_chunk_tokens=8192, learning_rate=1e-4)
    if variant.compile:  # compilation happens in the warm-up, never in the timed steps
        warmup = max(warmup, 1)
    peft_model = attach_lora(model, config)
    try:
        learner = Learner(peft_model, config, device)
        seqs = sequences(n_seqs, seq_len, model.config.vocab_size)
        seconds, warm = timed(lambda: learner.step(seqs), warmup, steps, device)
        if profile:  # one more step under the profiler: where the GPU time goes, top kernels
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                learner.step(seqs)
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60),
                  flush=True)
        return seconds, warm
    finally:
        peft_model.unload()  # the base model goes on to the next variant (compiled layers stay compiled)


class Report:
    """Runs as JSON lines on stdout and the whole record in ``--out``, rewritten after every run."""

    def __init__(self, path: str | None, header: dict) -> None:
        self.path = path
        self.results = {**header, "runs": []}

    def add(self, run: dict) -> None:
        self.results["runs"].append(run)
        print(json.dumps(run), flush=True)
        if self.path:
            Path(self.path).write_text(json.dumps(self.results, indent=1))


def run_record(shape: str, path: str, tps: float, fpt: dict, **extra) -> dict:
    return {"shape": shape, "path": path, "tokens_per_s": round(tps, 1), "mfu_4N": round(tps * fpt["4N+attn"] / PEAK, 4),
            "mfu_6N": round(tps * fpt["6N+attn"] / PEAK, 4), **extra}


def single(args, variants: list[Variant], report: Report, device: torch.device, dtype: torch.dtype) -> None:
    rows_per_shape = [int(r) for r in args.rows.split(",")]
    for i, shape in enumerate(args.shapes.split(",")):
        model = build(shape, device, dtype)
        fpt = flops_per_token(model, args.seq_len)
        default_rows = rows_per_shape[min(i, len(rows_per_shape) - 1)]
        print(f"{shape}: N = {fpt['N'] / 1e9:.3f}B matmul params, {fpt['4N+attn'] / 1e9:.2f} GFLOP/token (4N+attn)",
              flush=True)
        base_tps = first_eager = None
        if not args.no_baseline:
            free_memory(device)
            base_tps = baseline(model, args.seq_len, args.warmup, args.steps, device)
            report.add(run_record(shape, "baseline transformers+peft, 1 seq", base_tps, fpt, rows=1,
                                  max_mem_gib=round(peak_gib(device), 1)))
        for variant in variants:
            rows = variant.rows or default_rows
            free_memory(device)
            try:
                seconds, warm = ours(model, variant, rows, args.seq_len, args.seqs_per_step, args.warmup,
                                     args.steps, device, profile=args.profile)
            except Exception as exc:  # report and go on: one failed variant (OOM) must not lose the others
                report.add({"shape": shape, "path": variant.label(rows), "error": f"{type(exc).__name__}: {exc}"[:500]})
                continue
            tps = args.seqs_per_step * args.seq_len / seconds
            if variant.mode == "eager" and first_eager is None:  # the first eager run: the reference
                first_eager = tps
            report.add(run_record(shape, variant.label(rows), tps, fpt, mode=variant.mode, rows=rows,
                                  recompute=variant.recompute, max_mem_gib=round(peak_gib(device), 1),
                                  warmup_s=round(warm, 1), vs_baseline=base_tps and round(tps / base_tps, 3),
                                  vs_first_eager=first_eager and round(tps / first_eager, 3)))
        del model
        free_memory(device)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, shape: str, variant: Variant, rows: int, opts: dict,
               out: str) -> None:
    """One rank of a --nproc measurement (its own process)."""
    import torch.distributed as dist

    cuda = opts["device"] == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:  # ranks share the CPU cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, device_id=device if cuda else None)
    try:
        model = build(shape, device, torch.bfloat16 if cuda else torch.float32)
        seconds, warm = ours(model, variant, rows, opts["seq_len"], opts["seqs_per_step"] * world, opts["warmup"],
                             opts["steps"], device)
        stats = torch.tensor([seconds, warm, peak_gib(device)], dtype=torch.float64, device=device)
        if world > 1:  # the slowest rank sets the pace
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)
        if rank == 0:
            name = torch.cuda.get_device_name(device) if cuda else "cpu"
            Path(out).write_text(json.dumps({"seconds": stats[0].item(), "warmup_s": stats[1].item(),
                                             "max_mem_gib": stats[2].item(), "device": name,
                                             "flops": flops_per_token(model, opts["seq_len"])}))
    finally:
        if world > 1:
            dist.destroy_process_group()


def multi(args, variants: list[Variant], report: Report) -> None:
    import torch.multiprocessing as mp

    for key, value in NCCL_SAFE_ENV.items():
        os.environ.setdefault(key, value)
    if args.device == "cuda" and torch.cuda.device_count() < args.nproc:
        raise SystemExit(f"--nproc {args.nproc}: only {torch.cuda.device_count()} CUDA devices")
    opts = {"device": args.device, "seq_len": args.seq_len, "seqs_per_step": args.seqs_per_step,
            "warmup": args.warmup, "steps": args.steps}
    rows_per_shape = [int(r) for r in args.rows.split(",")]
    for i, shape in enumerate(args.shapes.split(",")):
        for variant in variants:
            rows = variant.rows or rows_per_shape[min(i, len(rows_per_shape) - 1)]
            one = None
            for world in (1, args.nproc):
                with tempfile.TemporaryDirectory() as tmp:
                    out = str(Path(tmp) / "rank0.json")
                    try:
                        mp.spawn(_rank_main, args=(world, _free_port(), shape, variant, rows, opts, out), nprocs=world)
                        r = json.loads(Path(out).read_text())
                    except Exception as exc:  # report and go on to the next variant
                        report.add({"shape": shape, "path": variant.label(rows), "ranks": world,
                                    "error": f"{type(exc).__name__}: {exc}"[-500:]})
                        break
                tps = args.seqs_per_step * world * args.seq_len / r["seconds"]
                record = run_record(shape, variant.label(rows), tps, r["flops"], ranks=world, mode=variant.mode,
                                    rows=rows, recompute=variant.recompute, max_mem_gib=round(r["max_mem_gib"], 1),
                                    warmup_s=round(r["warmup_s"], 1), device=r["device"])
                record["mfu_4N"] = round(record["mfu_4N"] / world, 4)  # per GPU
                record["mfu_6N"] = round(record["mfu_6N"] / world, 4)
                if world == 1:
                    one = tps
                else:
                    record["scaling_efficiency"] = round(tps / (world * one), 3)
                report.add(record)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="qwen2.5-1.5b")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--seqs-per-step", type=int, default=8, help="sequences per optimizer step (per rank with --nproc)")
    p.add_argument("--rows", default="4", help="default rows (sequences) per micro-batch, per shape: e.g. 4,2")
    p.add_argument("--variants", default="eager,compile", help="MODE[:rN][:recompute], comma-separated (see above)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    p.add_argument("--nproc", type=int, default=0, help="measure each variant on 1 and on N ranks (scaling)")
    p.add_argument("--out", default=None)
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--profile", action="store_true", help="print the top CUDA kernels of one step per variant")
    args = p.parse_args()
    variants = sorted((Variant.parse(v) for v in args.variants.split(",")), key=lambda v: v.mode != "eager")
    import transformers

    # not torch.cuda.get_device_name here: with --nproc the parent must not hold a CUDA context (runs report it)
    header = {"device": args.device, "cuda_devices": torch.cuda.device_count(), "torch": torch.__version__,
              "transformers": transformers.__version__, "seq_len": args.seq_len, "seqs_per_step": args.seqs_per_step,
              "argv": sys.argv[1:], "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
    report = Report(args.out, header)
    if args.nproc:
        multi(args, variants, report)
    else:
        device = torch.device(args.device)
        report.results["gpu"] = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        single(args, variants, report, device, torch.bfloat16 if device.type == "cuda" else torch.float32)


if __name__ == "__main__":
    main()
