"""Plot reward against wall-clock time for each mode of one or more `bench/loop_bench.py` results.

    python bench/plot_loop.py docs/results/loop-gpu/two-gpu.json docs/results/loop-gpu/one-gpu.json \
        --out docs/results/loop-gpu/reward-vs-time.png

Needs matplotlib (`pip install matplotlib`; not a streamrl dependency). The curve is the mean reward of
the groups each trainer step trained on, at the time the step finished, from the gateway being ready.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(args.results), figsize=(6 * len(args.results), 4), squeeze=False)
    for ax, path in zip(axes[0], args.results, strict=True):
        data = json.loads(Path(path).read_text())
        for mode, r in data["modes"].items():
            curve = r["reward_curve"]
            ax.plot([t for t, _, _ in curve], [y for _, y, _ in curve], marker="o", label=(
                f"{mode}: target at {r['time_to_target_s']:.0f} s" if r.get("time_to_target_s") else mode))
        ax.axhline(data["args"]["until_reward"], color="grey", linestyle=":", linewidth=1)
        ax.set_title(f"{data['args']['shape']}, layout {data['args']['layout']}")
        ax.set_xlabel("seconds since the gateway was ready")
        ax.set_ylabel("mean reward of the groups trained")
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)


if __name__ == "__main__":
    main()
