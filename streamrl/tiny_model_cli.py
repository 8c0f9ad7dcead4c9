"""Write a random-initialised Qwen2-architecture model with a locally trained tokenizer and a chat
template (no model hub is needed). ``--shape`` picks the tiny test model or a real model's layer sizes."""

from __future__ import annotations

import argparse

from .tiny_model import SHAPES, build_model

DESCRIPTION = """\
Write a small random-initialised model with its own tokenizer and chat template: for tests and
benchmarks (--shape gives a real model's layer sizes with random weights).

  streamrl tiny-model ./models/tiny"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="output directory")
    p.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=None, help="override the shape's vocabulary size")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])


def run(args: argparse.Namespace) -> int:
    out = build_model(args.dir, args.shape, seed=args.seed, vocab_size=args.vocab_size, dtype=args.dtype)
    print(f"model written to {out}")
    return 0
