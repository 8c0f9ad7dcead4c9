"""The learning benchmark end to end on the CPU: bench/learn_bench.py's ``tiny`` preset, one seed of two modes
(``sync``, the baseline, and ``sft-pipeline``: the pipeline started from an SFT warm-up on the task's own
demonstrations, so the pipeline's feed and the warm start in one run), runs of a few seconds against the
session's vLLM engine, then ``merge`` of the result split in two. Checks the harness (every mode ran, one after
the other; the statistics are there and merge recomputes them), not learning: runs this short measure nothing.
The order over several seeds is ``run_order``'s, unit-tested in tests/unit/test_learn_stats.py; each run costs
its parts' start and stop, so one seed and two modes here."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support.up_run import processes_mentioning

from streamrl.engine.server import Engine

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench" / "learn_bench.py"
SEEDS, MODES = (0,), ("sync", "sft-pipeline")


def bench(args: list[str], log: Path, timeout: float) -> int:
    """``learn_bench.py ARGS`` until it exits, in its own process group (stopped whole if it overruns)."""
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, str(BENCH), *args], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
            pytest.fail(f"learn_bench did not finish within {timeout:.0f} s; log: {log}")


def test_tiny_preset_interleaves_every_mode_and_seed_and_merges(engine: Engine, tiny_model: Path,
                                                                tmp_path: Path) -> None:
    out = tmp_path / "learn"
    code = bench(["run", "--preset", "tiny", "--seeds", ",".join(map(str, SEEDS)), "--modes", ",".join(MODES),
                  "--upstream", engine.url, "--model", str(tiny_model), "--port", "0", "--max-seconds", "3",
                  "--times-s", "1.5", "--times-s", "3", "--sft-examples", "128", "--sft-epochs", "1",
                  "--out", str(out)], tmp_path / "run.log", timeout=600)
    log = (tmp_path / "run.log").read_text()
    assert code == 0, log[-5000:]
    result = json.loads((out / "learn_bench.json").read_text())

    runs = result["runs"]
    assert sorted((r["seed"], r["mode"]) for r in runs) == sorted((s, m) for s in SEEDS for m in MODES)
    assert all(r["complete"] and r["exit_code"] == 0 for r in runs), [(r["mode"], r["seed"], r.get("why")) for r in runs]
    # in run_order's order, each run after the previous one ended
    expected = [[0, m] for m in MODES]
    assert result["order"] == expected
    assert [[r["seed"], r["mode"]] for r in sorted(runs, key=lambda r: r["started_at"])] == expected
    for before, after in itertools.pairwise(runs):
        assert after["started_at"] >= before["started_at"] + before["wall_s"] - 1.0
    for r in runs:
        assert r["score_source"] == "served reward" and r["curve"], "the numbers task is scored by served reward"
        assert r["steps"] >= 1 and r["versions_per_s"] > 0
        assert set(r["staleness"]) == {"source", "mean", "p90", "max", "shares"} and r["reply_tokens"]["max"] <= 16
        assert abs(sum(r["staleness"]["shares"].values()) - 1) < 1e-9
        assert r["trainer_waiting"] is None if r["steps"] < 2 else 0 <= r["trainer_waiting"] <= 1
        # exact figures: per sampled token from the history's histograms, per reply from the demo summary
        assert r["staleness"]["source"] == "trainer history, per token"
        assert r["reply_tokens"]["source"] == "demo summary, per reply" and r["reply_tokens"]["n"] >= 1
        assert r["publish_to_served"]["versions"] >= 1 and r["requests_failed"] == 0
        assert "idle_s" in r["engine"], "the shared engine's metrics are polled"
        assert (r["engine"]["lora_slot_wait_s"], r["engine"]["lora_slot_waited"]) == (0, []), \
            "the engine's GPU LoRA slots hold every version the gateway keeps loaded: none waits for one"

    # the warm start: SFT on the task's demonstrations, published as v1 before the first step (v2), and its
    # seconds on the run's clock
    warm = next(r for r in runs if r["mode"] == "sft-pipeline")
    sft = warm["warm_start"]
    assert sft["summary"]["steps"] >= 1 and sft["summary"]["sequences"] > 0 and sft["seconds"] > 0
    assert warm["reward_curve"][0][2] == 2, "v1 is the SFT adapter, the first trained version v2"
    assert min(p[0] for p in warm["curve"]) >= sft["seconds"]
    assert all("warm_start" not in r for r in runs if r["mode"] != "sft-pipeline")

    stats = result["stats"]
    assert stats["seeds"] == {m: list(SEEDS) for m in MODES}
    assert [row["level"] for row in stats["levels"]] == [0.5, 0.6, 0.7]
    for row in stats["levels"]:
        for m in MODES:
            cell = row["modes"][m]
            assert cell["reached"] + cell["not_reached"] == len(SEEDS)
            assert {"median", "interval_90", "per_seed"} <= cell.keys()
        assert {"median", "interval_90", "neither_reached"} <= row["speedup"]["sft-pipeline/sync"].keys()
    assert [row["t_s"] for row in stats["at_times"]] == [1.5, 3.0]
    for m in MODES:
        figures = stats["modes"][m]
        assert {"versions_per_s", "staleness_per_token", "reply_tokens", "engine_idle_s",
                "publish_to_served_ms", "failed_requests", "failed_trajectories"} <= figures.keys()
        assert figures["failed_requests"]["total"] == 0

    # one file per mode, as from two device commands, merged back: the same statistics
    halves = []
    for mode in MODES:
        half = dict(result, runs=[r for r in runs if r["mode"] == mode], modes=[mode])
        halves.append(tmp_path / f"{mode}.json")
        halves[-1].write_text(json.dumps(half))
    merged_path = tmp_path / "merged.json"
    assert bench(["merge", str(merged_path), *map(str, halves)], tmp_path / "merge.log", timeout=120) == 0, \
        (tmp_path / "merge.log").read_text()
    merged = json.loads(merged_path.read_text())
    assert merged["stats"]["levels"] == stats["levels"]
    assert merged["stats"]["at_times"] == stats["at_times"]
    assert {r["source"] for r in merged["runs"]} == {str(p) for p in halves}
    assert processes_mentioning(str(out)) == [], "no part of any run may outlive it"
