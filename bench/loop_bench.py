"""The whole loop, pipeline against synchronous: now ``bench/learn_bench.py run`` (one harness, with seeds,
presets and statistics over seeds). This name stays so that the commands in docs/benchmarks.md's older sections
still run: the same flags, ``--seed N`` as one seed, and as before each mode starting its own engine unless
``--shared-engine`` is given. The result file is ``OUT/learn_bench.json`` (runs by mode and seed).

    python bench/loop_bench.py --layout cpu --shape tiny --out runs/loop-bench-cpu     # = learn_bench.py run ...
"""

from __future__ import annotations

import sys

from learn_bench import main


def alias_args(argv: list[str]) -> list[str]:
    """loop_bench's arguments as ``learn_bench.py run``'s: its own engine per mode unless it asked for a shared one."""
    shared = any(a in ("--shared-engine", "--no-shared-engine") for a in argv)
    return ["run", *([] if shared else ["--no-shared-engine"]), *argv]


if __name__ == "__main__":
    sys.exit(main(alias_args(sys.argv[1:])))
