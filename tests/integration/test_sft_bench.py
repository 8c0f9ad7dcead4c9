"""bench/sft_bench.py on the CPU with the tiny model: both paths train the same steps on the same tokens (the
comparison is fair), and agree on the loss; speed is measured on a GPU (docs/benchmarks.md), not here."""

from __future__ import annotations

import json
from pathlib import Path

from support.bench_module import load_bench


def test_both_paths_train_the_same_tokens_to_the_same_loss(tiny_model: Path, tmp_path: Path) -> None:
    bench = load_bench("sft_bench")
    out = tmp_path / "result.json"
    assert bench.main(["--model", str(tiny_model), "--device", "cpu", "--steps", "3", "--warmup-steps", "1",
                       "--step-tokens", "1024", "--examples", "64", "--rounds", "1", "--out", str(tmp_path / "b"),
                       "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    ours, plain = result["rounds"][0]["streamrl"], result["rounds"][0]["plain"]
    assert ours["timed_steps"] == plain["timed_steps"] == 2
    assert ours["tokens"] == plain["tokens"] > 0  # the same sequences in the same steps
    assert 0 < plain["padding_share"] < 1
    assert abs(ours["loss_last"] - plain["loss_last"]) < 0.02 * plain["loss_last"]
    assert result["ratio_median"] == ours["tokens_per_s"] / plain["tokens_per_s"] > 0
