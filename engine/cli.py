"""Run a vLLM OpenAI server with runtime LoRA loading and processed (sampling) logprobs."""

from __future__ import annotations

import argparse
import threading

from streamrl.child import serve_until_stopped, stop_on_signals
from streamrl.config_flags import add_config_flags, given
from streamrl.engine.server import Engine, EngineConfig
from streamrl.usage import UsageError, as_usage_error, check_model, check_port_free

DESCRIPTION = """\
A vLLM OpenAI server set up for streamrl: runtime LoRA loading (the gateway loads each published version),
sampling logprobs, and token capture that the gateway records without slowing generation.

  streamrl engine --model DIR --port 8000
  streamrl engine --model DIR -- --tensor-parallel-size 2       further vLLM arguments after --

Options that matter most: --model, --port, --gpu-memory-utilization, --max-loras. Docs: docs/gateway.md."""

DEFAULT_PORT = 8000
"""The port when none is given (vLLM's own default), so that ``streamrl engine`` answers where one looks."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_flags(p, EngineConfig, skip=("extra_args",))
    p.add_argument("extra", nargs=argparse.REMAINDER, help="further vLLM arguments after --")


def run(args: argparse.Namespace) -> int:
    values = {"port": DEFAULT_PORT, **given(args, EngineConfig)}
    if "model" not in values:
        raise UsageError("--model is required (a checkpoint directory, or a name from streamrl model --list)")
    check_model(values["model"])
    with as_usage_error():
        config = EngineConfig(**values, extra_args=[a for a in args.extra if a != "--"])
    check_port_free(config.host, config.port, "--port")
    engine = Engine(config).start()
    print(f"engine ready: {engine.url}", flush=True)
    stop = threading.Event()
    stop_on_signals(stop)
    if not serve_until_stopped(engine.proc, stop):
        print("engine exited", flush=True)
        return 1
    engine.stop()
    return 0
