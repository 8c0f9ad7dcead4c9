"""Pools the same-round ratios of several ``capture_bench.py`` runs into one figure with its uncertainty.

One run's rounds are too few on a host whose speed moves from one minute to the next (docs/gpu.md "The host"):
plain chat alone moved 27.5k-39.9k tokens/s within one run. Each round runs every mode back to back, so a mode's
speed over plain chat's *in the same round* cancels most of that drift; this reads those per-round ratios from
each run's JSON, pools them, and reports per comparison the median, a 90% bootstrap interval of that median,
and the geometric mean. Comparisons: every mode against ``chat`` (``chat-stream`` for ``gateway-stream``, as
in the bench), and ``gateway`` against ``chat-capture``: what the gateway adds on top of the engine's capture.

    python bench/capture_pool.py docs/results/capture-h200-2026-12-02-621d5c2/capture.json docs/results/capture-h200-2026-12-04/capture.json ...
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Any

from capture_bench import baseline_mode, paired_ratios


def comparisons(modes: dict[str, dict[str, Any]]) -> dict[str, list[float]]:
    """``"mode / baseline"`` -> the ratio in each round of one run (the bench's own pairing), plus the gateway
    over capture straight to the engine."""
    pairs = [(mode, baseline_mode(modes, mode)) for mode in modes if mode != "chat"]
    if "gateway" in modes and "chat-capture" in modes:
        pairs.append(("gateway", "chat-capture"))
    return {f"{mode} / {base}": paired_ratios(modes, mode, base) for mode, base in pairs if base in modes}


def median_interval(ratios: list[float], level: float = 0.9, resamples: int = 20_000,
                    seed: int = 1) -> tuple[float, float]:
    """A percentile-bootstrap interval of the median (seeded: the same files give the same figures)."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    tail = (1 - level) / 2
    return medians[int(tail * resamples)], medians[min(resamples - 1, int((1 - tail) * resamples))]


def pool(paths: list[Path]) -> dict[str, dict[str, object]]:
    """Per comparison: the rounds pooled over ``paths``, their median, interval and geometric mean, per run medians."""
    pooled: dict[str, list[float]] = {}
    per_run: dict[str, list[float]] = {}
    for path in paths:
        for name, ratios in comparisons(json.loads(path.read_text())["modes"]).items():
            if ratios:
                pooled.setdefault(name, []).extend(ratios)
                per_run.setdefault(name, []).append(round(statistics.median(ratios), 3))
    report: dict[str, dict[str, object]] = {}
    for name, ratios in pooled.items():
        low, high = median_interval(ratios)
        report[name] = {"rounds": len(ratios), "median": round(statistics.median(ratios), 3),
                        "interval_90": [round(low, 3), round(high, 3)],
                        "geometric_mean": round(statistics.geometric_mean(ratios), 3),
                        "run_medians": per_run[name]}
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", type=Path, help="capture_bench.py --json files")
    p.add_argument("--json", type=Path, help="write the pooled figures here too")
    args = p.parse_args()
    report = pool(args.runs)
    if not report:
        print("no per-round speeds in these files (a run of one round has none to pair)", file=sys.stderr)
        return 1
    print("| same-round ratio | rounds | median | 90% interval of the median | geometric mean | median per run |")
    print("| --- | ---: | ---: | --- | ---: | --- |")
    for name, r in report.items():
        low, high = r["interval_90"]  # type: ignore[misc]
        runs = " / ".join(f"{m:.2f}" for m in r["run_medians"])  # type: ignore[union-attr]
        print(f"| {name} | {r['rounds']} | {r['median']:.3f} | {low:.2f}-{high:.2f} | {r['geometric_mean']:.3f} | {runs} |")
    if args.json:
        args.json.write_text(json.dumps({"runs": [str(p) for p in args.runs], "pooled": report}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
