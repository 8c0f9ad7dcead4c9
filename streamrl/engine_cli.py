"""Run a vLLM OpenAI server with runtime LoRA loading and processed (sampling) logprobs."""

from __future__ import annotations

import argparse
import threading

from .child import serve_until_stopped, stop_on_signals
from .config_flags import add_config_flags, given
from .engine import Engine, EngineConfig

DEFAULT_PORT = 8000
"""The port when none is given (vLLM's own default), so that ``streamrl engine`` answers where one looks."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_flags(p, EngineConfig, skip=("extra_args",))
    p.add_argument("extra", nargs=argparse.REMAINDER, help="further vLLM arguments after --")


def run(args: argparse.Namespace) -> int:
    values = {"port": DEFAULT_PORT, **given(args, EngineConfig)}
    if "model" not in values:
        raise SystemExit("streamrl engine: --model is required")
    engine = Engine(EngineConfig(**values, extra_args=[a for a in args.extra if a != "--"])).start()
    print(f"engine ready: {engine.url}", flush=True)
    stop = threading.Event()
    stop_on_signals(stop)
    if not serve_until_stopped(engine.proc, stop):
        print("engine exited", flush=True)
        return 1
    engine.stop()
    return 0
