"""`streamrl sft DATA --model MODEL --out DIR`: supervised fine-tuning of a LoRA adapter.

The trainer's own parts, not a second trainer: ``load_policy`` (LoRA from TrainerConfig's settings), the
``Learner`` (packing, gradient accumulation, clipping, AdamW) stepping with ``loss="sft"``, the checkpoint
of ``state.py`` and the adapter format of ``publish.py``. What is SFT's own is here: the data (``sft_data``),
batches by token budget, the held-out split, and the loop over epochs. docs/trainer.md, "Supervised fine-tuning".
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

from streamrl.config_flags import add_config_flags, given
from streamrl.usage import UsageError, as_usage_error, check_bootstrap_servers, check_file, check_model

from .config import TrainerConfig

log = logging.getLogger("streamrl.sft")

DESCRIPTION = """\
Supervised fine-tuning of a LoRA adapter with the trainer's model, packing and optimizer: on chat data
(JSONL/Parquet rows of OpenAI-format "messages", or a datasets dataset saved to disk) masked on the
assistant's tokens, or on what `streamrl export` wrote (the logged token ids, masked on the completions).
The adapter lands in OUT as the trainer writes one (`streamrl publish OUT` works); a rerun resumes there.

  streamrl sft chats.jsonl --model DIR --out sft-adapter --epochs 2
  streamrl sft best.parquet --model DIR --out student --publish --bootstrap-servers HOST:9092 --name policy

Docs: docs/trainer.md, "Supervised fine-tuning"."""

SHARED = ("model", "name", "bootstrap_servers", "topic_prefix", "kafka", "device", "cpu_threads", "seed",
          "report_to", "tracking_dir", "run_name", "learning_rate", "weight_decay", "adam_betas", "max_grad_norm",
          "micro_batch_tokens", "row_tokens", "logit_chunk_tokens", "recompute_logits", "attn_implementation",
          "normalize", "lora_rank", "lora_alpha", "lora_dropout", "target_modules", "init_adapter")
"""The TrainerConfig settings (flat names) that SFT takes as flags, with the trainer's meaning and defaults."""

HISTORY_FILE = "sft_history.jsonl"


@dataclass
class SftConfig:
    """SFT's own settings; the model, LoRA and optimizer settings are TrainerConfig's (``SHARED``)."""

    data: str = ""
    """JSONL or Parquet file, or a datasets directory (save_to_disk)."""
    out: str = ""
    """Directory of the adapter (and of the checkpoint, in OUT/.state, that a rerun resumes from)."""
    epochs: int = 1
    """Passes over the training split (ignored when --max-steps is given)."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (passes repeat as needed)."""
    step_tokens: int = 16_384
    """Tokens (prompt and target) per optimizer step: sequences are taken until a step holds this many."""
    max_seq_tokens: int = 4096
    """Longer sequences are skipped (counted too_long)."""
    eval_fraction: float = 0.05
    """Share of the sequences held out to report held-out loss and token accuracy (0: none)."""
    eval_every: int = 50
    """Evaluate every this many steps (and at the start and the end)."""
    save_every: int = 50
    """Write the adapter and the checkpoint every this many steps (and at the end)."""
    final_turn_only: bool = False
    """Chat rows: train on the final assistant turn only, not every assistant turn."""
    publish: bool = False
    """At the end, publish the adapter as the next version of --name on the policy topic."""
    publisher: str = "streamrl-sft"
    """The policy record's publisher (gateways may serve only trusted publishers)."""
    progress: bool = True
    """A progress bar on stderr."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError("eval_fraction must be in [0, 1)")
        for name in ("epochs", "step_tokens", "max_seq_tokens", "eval_every", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError("max_steps must be >= 1")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("data", help="JSONL or Parquet file (chat rows or `streamrl export` rows), or a datasets directory")
    add_config_flags(p, SftConfig, skip=("data",))
    add_config_flags(p, TrainerConfig, only=SHARED)


def configs_from_args(args: argparse.Namespace) -> tuple[SftConfig, TrainerConfig]:
    with as_usage_error():
        sft = SftConfig(data=args.data, **given(args, SftConfig))
    return sft, TrainerConfig.load(None, **given(args, TrainerConfig))


def preflight(sft: SftConfig, trainer: TrainerConfig) -> None:
    """A user's mistakes, before torch and the model load."""
    if not trainer.model:
        raise UsageError("--model is required (the base model's checkpoint directory, as vLLM serves it)")
    check_model(trainer.model)
    if not sft.out:
        raise UsageError("--out is required (the directory the adapter is written to)")
    if trainer.lora.init_adapter:
        check_file(Path(trainer.lora.init_adapter) / "adapter_model.safetensors", "--init-adapter")
    if not Path(sft.data).exists():
        raise UsageError(f"DATA {sft.data}: no such file or directory")
    if Path(sft.out).exists() and not Path(sft.out).is_dir():
        raise UsageError(f"--out {sft.out} exists and is not a directory")
    if sft.publish:
        check_bootstrap_servers(trainer.kafka.bootstrap_servers, "--bootstrap-servers")
        with as_usage_error():
            trainer.kafka.client_kwargs()


def batches(sequences: list, step_tokens: int, seed: int, epoch: int) -> list[list]:
    """An epoch's steps: the sequences shuffled (by seed and epoch, so a resumed run rebuilds the same
    steps), cut whenever a step holds ``step_tokens`` tokens."""
    import numpy as np

    order = np.random.default_rng([seed, epoch]).permutation(len(sequences))
    out, cur, n = [], [], 0
    for i in order:
        cur.append(sequences[i])
        n += len(sequences[i].token_ids)
        if n >= step_tokens:
            out.append(cur)
            cur, n = [], 0
    if cur:
        out.append(cur)
    return out


def split(sequences: list, fraction: float, seed: int) -> tuple[list, list]:
    """(train, held out): ``fraction`` of the sequences, at least one when there are two or more."""
    import numpy as np

    if fraction <= 0 or len(sequences) < 2:
        return sequences, []
    k = min(max(1, round(len(sequences) * fraction)), len(sequences) - 1)
    order = np.random.default_rng([seed, 1 << 20]).permutation(len(sequences))
    held = set(order[:k].tolist())
    return [s for i, s in enumerate(sequences) if i not in held], [sequences[i] for i in sorted(held)]


def run_sft(sft: SftConfig, c: TrainerConfig) -> dict:
    """Train, checkpoint, write the adapter (and publish it); returns the summary printed at the end."""
    import os

    import torch
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from tqdm import tqdm
    from transformers import AutoTokenizer

    from .learner import Learner
    from .model import load_policy, pick_device
    from .publish import write_adapter_files
    from .sft_data import examples_batch, load_sft_data
    from .state import TrainerState, load_state, save_state
    from .tracking import numbers, open_trackers

    out, state_dir = Path(sft.out), Path(sft.out) / ".state"
    tokenizer = AutoTokenizer.from_pretrained(c.model)
    data = load_sft_data(Path(sft.data), tokenizer, final_turn_only=sft.final_turn_only,
                         max_tokens=sft.max_seq_tokens)
    log.info("data %s: %s", sft.data, data.summary())
    if not data.sequences:
        raise UsageError(f"DATA {sft.data}: no usable examples ({data.summary()})")
    train, held = split(data.sequences, sft.eval_fraction, c.seed)
    per_epoch = len(batches(train, sft.step_tokens, c.seed, 0))
    total = sft.max_steps if sft.max_steps is not None else sft.epochs * per_epoch

    device = pick_device(c.device)
    if device.type == "cpu":
        torch.set_num_threads(c.cpu_threads or max(1, len(os.sched_getaffinity(0)) // 2))
    torch.manual_seed(c.seed)
    model = load_policy(c, device)
    learner = Learner(model, c, device)
    state = load_state(state_dir) or TrainerState()
    if state.lora:  # resume: LoRA weights, optimizer moments and the position in the data
        set_peft_model_state_dict(model, state.lora)
        learner.optimizer.load_state_dict(state.optimizer)
        log.info("resuming at step %d (epoch %d, batch %d)", state.step, state.offsets.get("epoch", 0),
                 state.offsets.get("batch", 0))
    trackers = open_trackers(c.report_to, Path(c.tracking_dir) if c.tracking_dir else out / "tracking",
                             c.run_name or f"sft-{c.name}", {"sft": vars(sft), "model": c.model})
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"out": str(out), "rows": data.rows, "sequences": len(data.sequences), "train": len(train),
                     "held_out": len(held), "skipped": dict(data.skipped), "resumed_at": state.step}

    def record(entry: dict) -> None:
        with open(out / HISTORY_FILE, "a", encoding="utf-8") as history:  # one line per step or eval
            history.write(json.dumps(entry) + "\n")
        for t in trackers:
            t.log(numbers(entry), entry["step"])

    held_batch = examples_batch(held)

    def evaluate() -> None:
        if not held:
            return
        loss, accuracy, tokens = learner.evaluate(held_batch)
        summary.setdefault("eval_loss_first", loss)
        summary.update(eval_loss=loss, eval_accuracy=accuracy)
        record({"step": state.step, "eval_loss": loss, "eval_accuracy": accuracy, "eval_tokens": tokens})
        bar.write(f"step {state.step}: held-out loss {loss:.4f}, token accuracy {accuracy:.3f}")

    def save() -> None:
        write_adapter_files(model, out, {"version": 0, "step": state.step, "source": "sft", "base_model": c.model,
                                         "data": str(sft.data)})
        state.lora = {k: v.detach().cpu() for k, v in get_peft_model_state_dict(model).items()}
        state.optimizer = learner.optimizer.state_dict()
        save_state(state_dir, state)

    bar = tqdm(total=total, initial=min(state.step, total), unit="step", disable=not sft.progress, dynamic_ncols=True)
    try:
        evaluate()
        epoch, index = state.offsets.get("epoch", 0), state.offsets.get("batch", 0)
        while state.step < total:
            steps = batches(train, sft.step_tokens, c.seed, epoch)
            if index >= len(steps):
                epoch, index = epoch + 1, 0
                continue
            stats = learner.step(examples_batch(steps[index]), loss="sft")
            index += 1
            state.step += 1
            state.offsets = {"epoch": epoch, "batch": index}
            loss = stats.loss
            if not math.isfinite(loss):
                raise RuntimeError(f"step {state.step}: loss is {loss}: lower --learning-rate")
            record({"step": state.step, "epoch": epoch, "loss": loss, "tokens": stats.tokens,
                    "target_tokens": stats.sampled_tokens, "grad_norm": stats.grad_norm, "seconds": stats.seconds})
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", epoch=epoch)
            summary["loss"] = loss
            if state.step % sft.eval_every == 0 and state.step < total:
                evaluate()
            if state.step % sft.save_every == 0 and state.step < total:
                save()
        evaluate()
        save()
    finally:
        bar.close()
        for t in trackers:
            t.close()
    summary["steps"] = state.step
    if sft.publish:
        summary["published"] = publish(out, c, sft.publisher, state.step, summary)
    return summary


def publish(adapter: Path, c: TrainerConfig, publisher: str, step: int, summary: dict) -> dict:
    """The adapter as the next version of ``c.name`` on the policy topic (``streamrl publish``'s way)."""
    from streamrl.broker.policy_log import publish_version
    from streamrl.broker.topics import Topics

    metrics = {k: float(summary[k]) for k in ("eval_loss", "eval_accuracy", "loss") if k in summary}
    record = publish_version(c.kafka.bootstrap_servers, Topics(c.kafka.topic_prefix), c.name, None, adapter, c.model, step=step,
                             metrics=metrics, security=c.kafka, publisher=publisher, client_id="streamrl-sft")
    return {"name": record.name, "version": record.version, "path": record.path, "sha256": record.sha256}


def run(args: argparse.Namespace) -> int:
    sft, trainer = configs_from_args(args)
    preflight(sft, trainer)
    print(json.dumps(run_sft(sft, trainer)), flush=True)
    return 0
