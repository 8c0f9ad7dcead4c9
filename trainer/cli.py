"""`streamrl trainer`: the streaming GRPO trainer daemon (or `--replay DIR` to train from saved batches).

Options come from defaults, then `--config FILE` (TOML or JSON), then the flags given here.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
from pathlib import Path

from streamrl.child import stop_on_signals
from streamrl.config_flags import add_config_flags, given
from streamrl.usage import (
    UsageError,
    as_usage_error,
    check_bootstrap_servers,
    check_dir,
    check_file,
    check_model,
    check_port_free,
)

from .config import TrainerConfig

log = logging.getLogger("streamrl.trainer")

DESCRIPTION = """\
The streaming GRPO trainer: reads completions and rewards from Kafka, assembles reward-tagged groups, trains
a LoRA adapter on them and publishes each new version on the policy topic, which the gateways hot-swap.

  streamrl trainer --model DIR --bootstrap-servers HOST:9092 --adapters ./adapters
  streamrl trainer --config trainer.toml --learning-rate 2e-4
  streamrl trainer --model DIR --replay BATCHES_DIR     train from batches saved with --save-batches

Options that matter most: --model (the base model vLLM serves), --bootstrap-servers, --learning-rate,
--group-size, --groups-per-step, --lora-rank. Docs: docs/trainer.md."""

FLAG_NAMES = {"group_timeout_s": "group-timeout"}
"""Fields whose flag is not simply the field's name (``--field-name``)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML or JSON file of TrainerConfig fields (flags override it)")
    add_config_flags(p, TrainerConfig, names=FLAG_NAMES)


def config_from_args(args: argparse.Namespace) -> TrainerConfig:
    return TrainerConfig.load(args.config, **given(args, TrainerConfig))


def preflight(config: TrainerConfig) -> None:
    """What can be checked before torch and the model load: the model, the replay directory, the broker's
    address, the metrics port."""
    if not config.model:
        raise UsageError("--model is required (the base model's checkpoint directory, as vLLM serves it)")
    check_model(config.model)
    if config.lora.init_adapter:
        check_file(Path(config.lora.init_adapter) / "adapter_model.safetensors", "--init-adapter")
    if config.replay:
        check_dir(config.replay, "--replay")
    else:
        check_bootstrap_servers(config.kafka.bootstrap_servers, "--bootstrap-servers")
        with as_usage_error():  # its TLS files exist, its SASL password is somewhere
            config.kafka.client_kwargs()
    check_port_free("0.0.0.0", config.metrics_port, "--metrics-port")


def run(args: argparse.Namespace) -> int:
    stop = threading.Event()
    stop_on_signals(stop)  # first: a SIGTERM while torch loads or the model is read is a clean stop (the
    # trainer finishes its step, publishes and exits 0)
    config = config_from_args(args)
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if not distributed or os.environ.get("RANK", "0") == "0":  # rank 0 alone binds the metrics port
        preflight(config)
    import torch.distributed as dist

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
        code = run_trainer(config, stop)
    except BaseException:
        if distributed:  # no barrier: the other ranks may never reach one (they fail on the closed connection)
            dist.destroy_process_group()
        raise
    if distributed:
        # every rank's last collective (rank 0's broadcast of the stop) complete on all ranks before any of
        # them tears its connections down: without it rank 0 could still be sending when rank 1 had exited,
        # and gloo's teardown aborted the process (1 run in 14 on a loaded 2-core box)
        dist.barrier()
        dist.destroy_process_group()
    return code
