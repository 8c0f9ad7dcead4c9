"""`streamrl trainer`: the streaming GRPO trainer daemon (or `--replay DIR` to train from saved batches).

Options come from defaults, then `--config FILE` (TOML or JSON), then the flags given here.
"""

from __future__ import annotations

import argparse
import logging
import os

from .config import TrainerConfig

log = logging.getLogger("streamrl.trainer")

# flag -> (TrainerConfig field, type, help)
FLAGS: dict[str, tuple[str, type, str]] = {
    "--model": ("model", str, "base model path (also what vLLM serves)"),
    "--bootstrap-servers": ("bootstrap_servers", str, "Kafka bootstrap servers HOST:PORT"),
    "--adapters": ("adapters", str, "adapters are written to <adapters>/<name>/v<N>/"),
    "--name": ("name", str, "policy name (default policy)"),
    "--topic-prefix": ("topic_prefix", str, "topic prefix (default streamrl)"),
    "--group-size": ("group_size", int, "trajectories per group when the reward does not say"),
    "--groups-per-step": ("groups_per_step", int, "groups per optimizer step"),
    "--learning-rate": ("learning_rate", float, "AdamW learning rate"),
    "--lora-rank": ("lora_rank", int, "LoRA rank"),
    "--lora-alpha": ("lora_alpha", float, "LoRA alpha"),
    "--max-lag": ("max_lag", int, "drop samples more than this many versions old"),
    "--max-ready-groups": ("max_ready_groups", int, "bound on ready groups not yet trained (see --backlog)"),
    "--backlog": ("backlog", str, "freshest (default: beyond --max-ready-groups drop the oldest, train the newest "
                                  "first) or wait (pause reads from Kafka, train oldest first)"),
    "--max-step-tokens": ("max_step_tokens", int, "a step takes more than --groups-per-step groups when they are "
                                                  "ready, up to this many tokens (0: exactly --groups-per-step)"),
    "--metrics-port": ("metrics_port", int, "serve Prometheus /metrics on this port"),
    "--history": ("history", str, "append one JSON line per step to this file"),
    "--save-batches": ("save_batches", str, "also write each group batch as Parquet here"),
    "--replay": ("replay", str, "train from Parquet batches in this directory instead of Kafka"),
    "--device": ("device", str, "auto, cpu, cuda or cuda:N"),
    "--cpu-threads": ("cpu_threads", int, "torch threads when training on the CPU (0: half the cores)"),
    "--seed": ("seed", int, "random seed"),
    "--state-dir": ("state_dir", str, "checkpoint directory (default <adapters>/<name>/.state)"),
    "--group-timeout": ("group_timeout_s", float, "seconds before an incomplete group is trained or dropped"),
    "--max-steps": ("max_steps", int, "stop after this many optimizer steps"),
    "--micro-batch-tokens": ("micro_batch_tokens", int, "token budget of one packed micro-batch"),
    "--keep-versions": ("keep_versions", int, "version directories kept on disk"),
    "--kl-coef": ("kl_coef", float, "KL penalty to the base model (0 = off)"),
    "--is-mode": ("is_mode", str, "truncated_is (default) or ppo_clip"),
    "--normalize": ("normalize", str, "token (default) or sequence"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML or JSON file of TrainerConfig fields (flags override it)")
    for flag, (_, typ, text) in FLAGS.items():
        p.add_argument(flag, type=typ, default=None, help=text)


def config_from_args(args: argparse.Namespace) -> TrainerConfig:
    overrides = {field: getattr(args, flag[2:].replace("-", "_")) for flag, (field, _, _) in FLAGS.items()}
    return TrainerConfig.load(args.config, **overrides)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    if not config.model:
        raise SystemExit("streamrl trainer: --model is required")
    import torch.distributed as dist

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        import torch

        if torch.cuda.is_available() and config.device != "cpu":
            # one GPU per rank (torchrun's LOCAL_RANK): NCCL collectives run on this rank's own device
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device)
        else:
            dist.init_process_group("gloo")
    if not distributed or dist.get_rank() == 0:
        print("streamrl trainer, effective configuration:\n" + config.describe(), flush=True)
    from .daemon import run_trainer

    try:
        return run_trainer(config)
    finally:
        if distributed:
            dist.destroy_process_group()
