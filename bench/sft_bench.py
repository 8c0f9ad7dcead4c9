"""SFT throughput: ``streamrl sft`` (the trainer's learner: sequences packed into rows, logprobs only at the
target positions, chunked) against a plain transformers + peft loop (the same model, LoRA, optimizer, data and
steps; each micro-batch padded to its longest sequence, the model's own loss), in the same run.

    python3 bench/sft_bench.py --model DIR --json sft_bench.json                 # a GPU: cuda:0
    python3 bench/sft_bench.py --model DIR --device cpu --steps 3 --json F       # the CPU: harness only

Data: the arithmetic task's demonstrations (``--examples`` correct answers to training problems, as SFT
warm-up data is made in ``learn_bench.py``'s ``sft-*`` modes), or ``--data FILE`` (JSONL chat rows). Both
paths take the same ``--steps`` optimizer steps over the same sequences in the same order (``--step-tokens``
per step); the first ``--warmup-steps`` of each are not timed. Tokens/s counts the real tokens (prompt and
target) of the timed steps over their seconds, the device synchronised at each step's end. ``--rounds``
alternates which path runs first; the ratio streamrl / plain is reported per round and as their median.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
try:
    import streamrl.trainer
except ImportError:  # not installed: map the repository's folders (streamrl.trainer -> trainer/)
    sys.path.insert(0, str(ROOT))
    import streamrl

    streamrl.__path__.append(str(ROOT))


def write_demonstrations(path: Path, n: int, seed: int) -> None:
    """``n`` correct arithmetic exchanges as JSONL chat rows (training problems, never held-out ones)."""
    from streamrl.producers.arithmetic import ArithmeticTask

    task, rng = ArithmeticTask(), random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            f.write(json.dumps({"messages": task.demonstration(task.sample(rng))}) + "\n")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_streamrl(args: argparse.Namespace, data: Path, out: Path) -> dict[str, Any]:
    """``streamrl sft`` in this process; tokens and seconds per step from its history file."""
    from streamrl.trainer.config import TrainerConfig
    from streamrl.trainer.sft import HISTORY_FILE, SftConfig, run_sft

    sft = SftConfig(data=str(data), out=str(out), max_steps=args.steps, step_tokens=args.step_tokens,
                    eval_fraction=0.0, progress=False)
    trainer = TrainerConfig.load(None, model=args.model, device=args.device, learning_rate=args.learning_rate,
                            lora_rank=args.lora_rank, seed=args.seed, micro_batch_tokens=args.micro_batch_tokens,
                            row_tokens=args.row_tokens)
    shutil.rmtree(out, ignore_errors=True)  # a directory left from before would be resumed, not trained
    t = time.monotonic()
    run_sft(sft, trainer)
    wall = time.monotonic() - t
    steps = [json.loads(x) for x in (out / HISTORY_FILE).read_text().splitlines() if '"loss"' in x]
    timed = steps[args.warmup_steps:]
    tokens, seconds = sum(s["tokens"] for s in timed), sum(s["seconds"] for s in timed)
    return {"steps": len(steps), "timed_steps": len(timed), "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "wall_s": wall, "loss_last": steps[-1]["loss"]}


def run_plain(args: argparse.Namespace, data: Path) -> dict[str, Any]:
    """The loop a transformers + peft user writes: chat template, labels -100 on the prompt, micro-batches of
    ``--plain-batch`` sequences right-padded, ``model(...).loss``, gradient accumulation over the step,
    clipping, AdamW. The steps hold the same sequences as ``streamrl sft``'s (its ``batches``)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from streamrl.trainer.config import TrainerConfig
    from streamrl.trainer.sft import batches
    from streamrl.trainer.sft_data import load_sft_data

    device = torch.device(args.device)
    c = TrainerConfig.load(None, model=args.model, device=args.device, lora_rank=args.lora_rank)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    sequences = load_sft_data(data, tokenizer).sequences  # the same ids and masks as streamrl's
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation=c.compute.attn_implementation)
    model = get_peft_model(model.to(device), LoraConfig(r=c.lora.rank, lora_alpha=c.lora.alpha,
                                                         target_modules=list(c.lora.target_modules), lora_dropout=0.0))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.learning_rate, betas=c.optim.adam_betas, weight_decay=c.optim.weight_decay)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    steps, epoch = [], 0
    while len(steps) < args.steps:
        steps += batches(sequences, args.step_tokens, args.seed, epoch)
        epoch += 1
    tokens = seconds = padded = 0.0
    loss = float("nan")
    for i, step in enumerate(steps[:args.steps]):
        t = time.monotonic()
        targets = sum(int(s.loss_mask.sum()) for s in step)
        for k in range(0, len(step), args.plain_batch):
            part = step[k:k + args.plain_batch]
            width = max(len(s.token_ids) for s in part)
            ids = torch.full((len(part), width), pad, dtype=torch.long)
            labels = torch.full((len(part), width), -100, dtype=torch.long)
            mask = torch.zeros((len(part), width), dtype=torch.long)
            for row, s in enumerate(part):
                n = len(s.token_ids)
                ids[row, :n] = torch.as_tensor(s.token_ids)
                mask[row, :n] = 1
                # the model shifts labels itself: label j is the token at j, scored from position j - 1
                labels[row, :n] = torch.where(torch.as_tensor(s.loss_mask, dtype=torch.bool),
                                              torch.as_tensor(s.token_ids), -100)
            out = model(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device))
            part_targets = int((labels[:, 1:] != -100).sum())
            (out.loss * part_targets / targets).backward()  # the step's mean over its target tokens
            if i >= args.warmup_steps:
                padded += ids.numel()
        torch.nn.utils.clip_grad_norm_(params, c.optim.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        loss = float(out.loss.detach())
        if i >= args.warmup_steps:
            tokens += sum(len(s.token_ids) for s in step)
            seconds += time.monotonic() - t
    return {"steps": args.steps, "timed_steps": args.steps - args.warmup_steps, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds, "padding_share": 1 - tokens / padded if padded else None,
            "loss_last": loss}


def free(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="checkpoint directory (streamrl model / tiny-model)")
    p.add_argument("--data", help="JSONL chat rows (default: the arithmetic task's demonstrations)")
    p.add_argument("--examples", type=int, default=4096, help="demonstrations written when no --data")
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--step-tokens", type=int, default=16384)
    p.add_argument("--micro-batch-tokens", type=int, default=16384, help="streamrl: tokens per micro-batch")
    p.add_argument("--row-tokens", type=int, help="streamrl: longest packed row (default: one row per micro-batch)")
    p.add_argument("--plain-batch", type=int, default=64, help="sequences per padded micro-batch (plain loop)")
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="runs/sft-bench", help="streamrl sft's adapter directories")
    p.add_argument("--json", help="the result file")
    args = p.parse_args(argv)
    if args.steps <= args.warmup_steps:
        p.error("--steps must exceed --warmup-steps")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = Path(args.data) if args.data else out / "demonstrations.jsonl"
    if not args.data:
        write_demonstrations(data, args.examples, args.seed)
    rounds = []
    for r in range(args.rounds):
        result: dict[str, Any] = {}
        for path in (("streamrl", "plain") if r % 2 == 0 else ("plain", "streamrl")):
            result[path] = run_streamrl(args, data, out / f"round-{r}") if path == "streamrl" else run_plain(args, data)
            free(args.device)
        result["ratio"] = result["streamrl"]["tokens_per_s"] / result["plain"]["tokens_per_s"]
        rounds.append(result)
        print(f"round {r}: streamrl {result['streamrl']['tokens_per_s']:,.0f} tokens/s, plain "
              f"{result['plain']['tokens_per_s']:,.0f} tokens/s (padding {result['plain']['padding_share']:.0%}): "
              f"{result['ratio']:.2f}x", flush=True)
    device_name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    summary = {"bench": "sft_bench", "device": device_name, "args": vars(args), "rounds": rounds,
               "ratio_median": statistics.median(r["ratio"] for r in rounds)}
    print(f"streamrl sft / plain transformers + peft, tokens/s: {summary['ratio_median']:.2f}x (median of "
          f"{len(rounds)} rounds, {device_name})")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
