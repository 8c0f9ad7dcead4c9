"""`streamrl judge`: score complete groups of trajectories with an LLM judge and post their rewards.

Options come from defaults, then `--config FILE` (TOML or JSON, a [judge] table if present), then flags.
"""

from __future__ import annotations

import argparse
import threading

from streamrl.child import stop_on_signals
from streamrl.config_flags import add_config_flags, given

from .config import JudgeConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML or JSON file of JudgeConfig fields (flags override it)")
    add_config_flags(p, JudgeConfig)


def run(args: argparse.Namespace) -> int:
    stop = threading.Event()
    stop_on_signals(stop)
    config = JudgeConfig.load(args.config, **given(args, JudgeConfig))
    if not config.model:
        raise SystemExit("streamrl judge: --model (the judge model's name at --base-url) is required")
    print("streamrl judge, effective configuration:\n" + config.describe(), flush=True)
    from .service import JudgeService

    return JudgeService(config, stop).run()
