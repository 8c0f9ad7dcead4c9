"""The capture benchmark's own arithmetic: the engine core's profile per token, against the same rounds' chat."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.bench_module import load_bench


@pytest.fixture(scope="module")
def bench():
    return load_bench("capture_bench")


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
    got, total = bench.function_samples(raw)
    assert total == 12 and got["run_busy_loop (core.py)"] == 12
    assert got["step (core.py)"] == 10
    assert got["sample (s.py)"] == 7 and got["compute_topk_scores (logprob.py)"] == 2


def test_core_profile_compares_per_token_with_the_same_rounds_baseline(bench) -> None:
    """A function's CPU per 1,000 tokens is its share of the round's samples times the engine core's CPU per
    1,000 tokens (so a profiler attached late changes nothing); medians over rounds; the functions that
    differ most from the baseline come first."""
    def round_(cpu: float, total: int, samples: dict[str, int]) -> dict:
        return {"cpu_ms_per_1k_tokens": {"engine_core": cpu}, "_core_total": total, "_core_samples": samples}

    chat = [round_(100.0, 100, {"step": 50, "sample": 10}), round_(100.0, 300, {"step": 150, "sample": 30})]
    capture = [round_(120.0, 100, {"step": 50, "sample": 10, "topk": 10}),
               round_(140.0, 50, {"step": 25, "sample": 5, "topk": 10})]
    rows = bench.core_profile(capture, chat)
    assert rows[0] == {"function": "topk", "cpu_ms_per_1k_tokens": 20.0, "baseline_cpu_ms_per_1k_tokens": 0.0}
    assert rows[1] == {"function": "step", "cpu_ms_per_1k_tokens": 65.0, "baseline_cpu_ms_per_1k_tokens": 50.0}
    assert rows[2] == {"function": "sample", "cpu_ms_per_1k_tokens": 13.0, "baseline_cpu_ms_per_1k_tokens": 10.0}
    assert bench.core_profile([round_(100.0, 0, {})], chat)[0]["cpu_ms_per_1k_tokens"] == 0.0  # no samples: none


def test_median_round_keeps_per_round_internals_out(bench) -> None:
    rounds = [{"tokens_per_s": t, "cpu_ms_per_1k_tokens": {}, "failures": 0, "errors": {}, "_core_samples": {"x": 1}}
              for t in (10.0, 30.0, 20.0)]
    got = bench.median_round(rounds)
    assert got["tokens_per_s"] == 20.0 and not any(k.startswith("_") for k in got)


def test_cpu_list_reads_the_kernels_format(bench) -> None:
    """sysfs writes ranges and single CPUs, comma-separated, with a newline; an empty list is no CPUs."""
    from gateway_bench import cpu_list  # capture_bench's path puts bench/ first

    assert cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert cpu_list("") == set() and cpu_list("5") == {5}


def test_placement_samples_the_thread_it_watches(bench) -> None:
    """This process's main thread is watched: every sample lands on a CPU this process may run on."""
    import os
    import time

    placement = bench.Placement(os.getpid(), None)
    deadline = time.monotonic() + 5
    while placement.samples < 3 and time.monotonic() < deadline:
        sum(range(10_000))
    got = placement.stop()
    assert got["samples"] >= 3
    assert {int(c) for c in got["engine_core_cpus"]} <= os.sched_getaffinity(0)
    assert sum(got["engine_core_nodes"].values()) == got["samples"]


@pytest.fixture(scope="module")
def pool():
    return load_bench("capture_pool")


def _run(path: Path, **rounds: list[float]) -> Path:
    path.write_text(json.dumps({"modes": {mode.replace("_", "-"): {"rounds_tokens_per_s": speeds}
                                          for mode, speeds in rounds.items()}}))
    return path


def test_pool_pairs_each_round_with_its_own_baseline_across_runs(pool, tmp_path: Path) -> None:
    """Ratios are taken within a round (a host twice as fast in one round changes nothing), pooled over runs;
    streamed through the gateway is compared with streamed straight, and the gateway with capture straight."""
    a = _run(tmp_path / "a.json", chat=[100.0, 200.0], chat_capture=[90.0, 190.0], gateway=[95.0, 170.0],
             chat_stream=[50.0, 100.0], gateway_stream=[40.0, 100.0])
    b = _run(tmp_path / "b.json", chat=[400.0], chat_capture=[400.0], gateway=[360.0])
    got = pool.pool([a, b])
    assert got["gateway / chat"]["rounds"] == 3
    assert got["gateway / chat"]["median"] == 0.9  # 0.95, 0.85, 0.9
    assert got["gateway / chat"]["run_medians"] == [0.9, 0.9]
    assert got["gateway-stream / chat-stream"]["median"] == 0.9  # 0.8, 1.0
    assert got["gateway / chat-capture"]["rounds"] == 3 and got["gateway / chat-capture"]["median"] == 0.9
    assert got["chat-stream / chat"]["median"] == 0.5 and "gateway-stream / chat" not in got  # as the bench pairs
    low, high = got["gateway / chat"]["interval_90"]
    assert 0.85 <= low <= 0.9 <= high <= 0.95
    assert got == pool.pool([a, b])  # seeded: the same files, the same figures


def test_pool_of_runs_without_rounds_reports_nothing(pool, tmp_path: Path) -> None:
    run = tmp_path / "one.json"
    run.write_text(json.dumps({"modes": {"chat": {"tokens_per_s": 1.0}, "gateway": {"tokens_per_s": 1.0}}}))
    assert pool.pool([run]) == {}
