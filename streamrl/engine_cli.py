"""Run a vLLM OpenAI server with runtime LoRA loading and processed (sampling) logprobs."""

from __future__ import annotations

import argparse
import signal
import threading

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
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(1.0):
        if engine.proc is not None and engine.proc.poll() is not None:
            return 1
    engine.stop()
    return 0
