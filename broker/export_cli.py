"""Export what the completions and rewards topics hold to Parquet or JSONL: one row per trajectory (its
reward, group, policy versions and calls, token-exact), e.g. for SFT on the best trajectories or offline
analysis. Reads up to the end offsets seen at start, never further; prints a JSON summary at the end.
Schema and examples: docs/export.md."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from streamrl.config_flags import add_config_flags, given

from .export import ExportOptions, export, parse_time
from .security import KafkaSettings

_OWN_FLAGS = ("out", "since_ms", "until_ms")
"""Fields with flags of their own (a positional path; times taken as ISO or epoch seconds)."""


DESCRIPTION = """\
Export what the log holds, one row per trajectory (its calls token-exact, reward, group, versions), to
Parquet or JSONL: for SFT on the best trajectories, distillation or offline analysis.

  streamrl export out.parquet --bootstrap-servers 127.0.0.1:9092 --min-reward 1

Docs: docs/export.md."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", type=Path, help="output file: OUT.parquet or OUT.jsonl (or give --format)")
    p.add_argument("--since", help="only records at or after this time: ISO 8601 (UTC unless it says) or epoch seconds")
    p.add_argument("--until", help="only records at or before this time: ISO 8601 or epoch seconds")
    add_config_flags(p, ExportOptions, skip=_OWN_FLAGS)


def options_from_args(args: argparse.Namespace) -> ExportOptions:
    """The options the flags give (defaults for the rest; Kafka security as every other part takes it)."""
    values = given(args, ExportOptions)
    values["kafka"] = KafkaSettings.of(values.get("kafka"))
    return ExportOptions(out=args.out, since_ms=None if args.since is None else parse_time(args.since),
                         until_ms=None if args.until is None else parse_time(args.until), **values)


def run(args: argparse.Namespace) -> int:
    try:
        options = options_from_args(args)
        options.resolved_format()
    except ValueError as exc:
        print(f"streamrl export: {exc}", file=sys.stderr)
        return 2
    summary = export(options)
    print(json.dumps(summary.as_dict()))
    return 0
