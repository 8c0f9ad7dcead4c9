"""Plot the held-out evaluation (``producers/evaluate.py``) against wall-clock time and against version.

    python bench/plot_eval.py docs/results/real-model-cpu-2026-12-01/demo-summary.json --out docs/results/real-model-cpu-2026-12-01/held-out.png
    python bench/plot_eval.py RUN/learn_bench.json --out held-out.png     (every run of a learning bench result)

Inputs: a demo summary (``streamrl up --demo`` writes ``<work_dir>/demo-summary.json``), a
``bench/learn_bench.py`` result or an older ``loop_bench.json``. Needs matplotlib (``pip install matplotlib``; not
a streamrl dependency). ``learn_bench.py`` draws its own plot over seeds, medians bold.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from learn_stats import labelled_runs


def series(data: dict) -> dict[str, list[tuple[float, int, float]]]:
    """(seconds since the demo started, version, score) per run name."""
    if "modes" in data or "runs" in data:  # a learning (or older loop) bench result
        runs = {name: [tuple(e) for e in r.get("evaluation", [])] for name, r in labelled_runs(data).items()}
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
