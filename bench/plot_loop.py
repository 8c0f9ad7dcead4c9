"""Plot reward against wall-clock time for each run of one or more `bench/learn_bench.py` results (or older
`loop_bench.json` files: one run per mode).

    python bench/plot_loop.py docs/results/loop-h200-2026-11-29/two-gpu.json docs/results/loop-h200-2026-11-29/one-gpu.json \
        --out docs/results/loop-h200-2026-11-29/reward-vs-time.png

Needs matplotlib (`pip install matplotlib`; not a streamrl dependency). Each point is one policy
version as the demo saw it served: the mean reward of its trajectories, at the time its first
trajectory finished (seconds since the demo started); ``--trained`` plots instead the mean reward of the
groups each trainer step trained on, at the time the step finished.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from learn_stats import labelled_runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+")
    p.add_argument("--out", required=True)
    p.add_argument("--trained", action="store_true", help="the trainer's curve instead of the served one")
    p.add_argument("--titles", default=None, help="panel titles separated by semicolons (default: shape and layout)")
    args = p.parse_args()
    titles = args.titles.split(";") if args.titles else [None] * len(args.results)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(args.results), figsize=(6 * len(args.results), 4), squeeze=False)
    for ax, path, title in zip(axes[0], args.results, titles, strict=True):
        data = json.loads(Path(path).read_text())
        for mode, r in labelled_runs(data).items():
            if args.trained:
                points = [(t, y) for t, y, _ in r["reward_curve"]]
            else:
                points = sorted((v["first_s"], v["mean"]) for k, v in r["demo"]["versions"].items()
                                if v.get("n") and int(k) >= 0)
            ax.plot([t for t, _ in points], [y for _, y in points], marker="o", label=(
                f"{mode}: target at {r['time_to_target_s']:.0f} s" if r.get("time_to_target_s") else mode))
        settings = data.get("preset") or data["args"]
        ax.axhline(settings["until_reward"], color="grey", linestyle=":", linewidth=1)
        ax.set_title(title or f"{settings['shape']}, layout {settings['layout']}")
        ax.set_xlabel("seconds (trainer steps)" if args.trained else "seconds since the demo started")
        ax.set_ylabel("mean reward of the groups trained" if args.trained else "mean reward served, per version")
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)


if __name__ == "__main__":
    main()
