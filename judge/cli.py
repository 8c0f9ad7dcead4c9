"""`streamrl judge`: score complete groups of trajectories with an LLM judge and post their rewards.

Options come from defaults, then `--config FILE` (TOML or JSON, a [judge] table if present), then flags.
"""

from __future__ import annotations

import argparse
import threading

from streamrl.child import stop_on_signals
from streamrl.config_flags import add_config_flags, given
from streamrl.usage import UsageError, as_usage_error, check_bootstrap_servers, check_url

from .config import JudgeConfig

DESCRIPTION = """\
An LLM judge: reads complete groups of trajectories from Kafka, asks a model (any OpenAI-compatible server,
the gateway included) to score them relative to each other, and posts their rewards.

  streamrl judge --base-url http://127.0.0.1:8080/v1 --model BASE_MODEL --bootstrap-servers 127.0.0.1:9092

Docs: docs/judge.md."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML or JSON file of JudgeConfig fields (flags override it)")
    add_config_flags(p, JudgeConfig)


def run(args: argparse.Namespace) -> int:
    stop = threading.Event()
    stop_on_signals(stop)
    config = JudgeConfig.load(args.config, **given(args, JudgeConfig))
    if not config.model:
        raise UsageError("--model (the judge model's name at --base-url) is required")
    check_url(config.base_url, "--base-url")
    check_bootstrap_servers(config.kafka.bootstrap_servers, "--bootstrap-servers")
    with as_usage_error():  # its TLS files exist, its SASL password is somewhere
        config.kafka.client_kwargs()
    print("streamrl judge, effective configuration:\n" + config.describe(), flush=True)
    from .service import JudgeService

    return JudgeService(config, stop).run()
