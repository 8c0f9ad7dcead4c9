"""Plot the held-out evaluation (``producers/evaluate.py``) against wall-clock time and against version.

    python bench/plot_eval.py docs/results/real-model-cpu/demo-summary.json --out docs/results/real-model-cpu/held-out.png
    python bench/plot_eval.py RUN/loop_bench.json --out held-out.png      (every mode of a loop bench run)

Inputs: a demo summary (``streamrl up --demo`` writes ``<work_dir>/demo-summary.json``) or a
``bench/loop_bench.py`` result. Needs matplotlib (``pip install matplotlib``; not a streamrl dependency).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def series(data: dict) -> dict[str, list[tuple[float, int, float]]]:
    """(seconds since the demo started, version, score) per run name."""
    if "modes" in data:  # a loop bench result
        runs = {mode: [tuple(e) for e in r.get("evaluation", [])] for mode, r in data["modes"].items()}
    else:
        t0 = data.get("started_at", 0.0)
        runs = {"demo": [(e["time"] - t0, e["version"], e["score"]) for e in data.get("evaluation", [])]}
    # an evaluation none of whose answers came from its version (it was unloaded first) scores NaN
    return {name: [p for p in points if p[2] == p[2]] for name, points in runs.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("result")
    p.add_argument("--out", required=True)
    p.add_argument("--title", default="held-out score per policy version")
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = series(json.loads(Path(args.result).read_text()))
    fig, (by_time, by_version) = plt.subplots(1, 2, figsize=(11, 4))
    for name, points in runs.items():
        if not points:
            continue
        by_time.plot([t for t, _, _ in points], [s for _, _, s in points], marker="o", label=name)
        by_version.plot([v for _, v, _ in points], [s for _, _, s in points], marker="o", label=name)
    by_time.set_xlabel("seconds since the demo started (when the evaluation finished)")
    by_version.set_xlabel("policy version (trainer steps)")
    for ax in (by_time, by_version):
        ax.set_ylabel("held-out score")
        ax.legend()
    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)


if __name__ == "__main__":
    main()
