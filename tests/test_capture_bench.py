"""The capture benchmark's own arithmetic: the engine core's profile per token, against the same rounds' chat."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "bench"))  # capture_bench imports gateway_bench beside it
    spec = importlib.util.spec_from_file_location("capture_bench", ROOT / "bench" / "capture_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_function_samples_are_inclusive_and_count_a_frame_once_per_stack(bench, tmp_path: Path) -> None:
    """A function is counted in every stack it appears in, once per stack (recursion does not double it),
    whatever line it was on; lines that are not stacks are skipped."""
    raw = tmp_path / "core.txt"
    raw.write_text("\n".join([
        "run_busy_loop (core.py:10);step (core.py:20);sample (s.py:5) 7",
        "run_busy_loop (core.py:10);step (core.py:21);step (core.py:22) 3",
        "run_busy_loop (core.py:11);compute_topk_scores (logprob.py:1) 2",
        "garbage",
    ]))
    got = bench.function_samples(raw)
    assert got["run_busy_loop (core.py)"] == 12
    assert got["step (core.py)"] == 10
    assert got["sample (s.py)"] == 7 and got["compute_topk_scores (logprob.py)"] == 2


def test_core_profile_compares_per_token_with_the_same_rounds_baseline(bench) -> None:
    """Samples are per 1,000 tokens (a round that made twice the tokens for twice the samples costs the
    same), medians over rounds, and the functions that differ most from the baseline come first."""
    chat = [{"completion_tokens": 1000, "_core_samples": {"step": 100, "sample": 10}},
            {"completion_tokens": 2000, "_core_samples": {"step": 200, "sample": 20}}]
    capture = [{"completion_tokens": 1000, "_core_samples": {"step": 100, "sample": 10, "topk": 8}},
               {"completion_tokens": 2000, "_core_samples": {"step": 260, "sample": 20, "topk": 12}}]
    rows = bench.core_profile(capture, chat)
    assert rows[0] == {"function": "step", "per_1k_tokens": 115.0, "baseline_per_1k_tokens": 100.0}
    assert rows[1] == {"function": "topk", "per_1k_tokens": 7.0, "baseline_per_1k_tokens": 0.0}
    assert rows[2] == {"function": "sample", "per_1k_tokens": 10.0, "baseline_per_1k_tokens": 10.0}


def test_median_round_keeps_per_round_internals_out(bench) -> None:
    rounds = [{"tokens_per_s": t, "cpu_ms_per_1k_tokens": {}, "failures": 0, "errors": {}, "_core_samples": {"x": 1}}
              for t in (10.0, 30.0, 20.0)]
    got = bench.median_round(rounds)
    assert got["tokens_per_s"] == 20.0 and not any(k.startswith("_") for k in got)
