"""Which of a virtual machine's CPUs share a physical core with a given one.

A KVM guest may report one thread per core while the hypervisor runs two of its vCPUs on the two
hyperthreads of one physical core: then work on one of them slows the other by a third or more, which no
counter in the guest shows (not steal time, not run delay). The gateway benchmark's event loop ran 45%
slower per call with its record producer busy on other vCPUs of the H200 host (docs/benchmarks.md), and
``gateway_bench.py --gateway-cpus`` can only keep the load off a core whose siblings are known.

This measures them: a Python loop pinned to ``--cpu`` counts its iterations while the same loop runs
pinned to each other CPU in turn, against the rate with every other CPU idle (measured before and after
each, so that a host whose speed drifts is compared with itself). A CPU whose load slows the probe by more
than ``--threshold`` is reported as its sibling.

    python bench/cpu_siblings.py [--cpu 0] [--seconds 1.5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time
from pathlib import Path


def spin(cpu: int | None, seconds: float, counter: mp.Value | None) -> None:  # type: ignore[valid-type]
    """Pure-interpreter work (the gateway's kind) on ``cpu`` (None: anywhere) for ``seconds``; iterations into
    ``counter``. Its working set stays in the core's own caches (gateway_bench's ``off-compute`` neighbours)."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    end, n, x = time.perf_counter() + seconds, 0, 0
    while time.perf_counter() < end:
        for i in range(1000):
            x = (x + i * i) % 1_000_003
        n += 1
    if counter is not None:
        counter.value = n  # type: ignore[attr-defined]


def probe_rate(cpu: int, seconds: float, load_cpu: int | None) -> float:
    """Iterations per second of the probe on ``cpu`` while the same loop runs on ``load_cpu`` (or nothing)."""
    ctx = mp.get_context("spawn")
    counter = ctx.Value("q", 0)
    load = None
    if load_cpu is not None:
        load = ctx.Process(target=spin, args=(load_cpu, seconds + 1.0, None))
        load.start()
        time.sleep(0.3)  # the load is running before the probe starts
    probe = ctx.Process(target=spin, args=(cpu, seconds, counter))
    probe.start()
    probe.join()
    if load is not None:
        load.terminate()
        load.join()
    return counter.value / seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", type=int, default=0, help="the CPU whose siblings are wanted")
    p.add_argument("--seconds", type=float, default=1.5, help="probe time per measurement")
    p.add_argument("--threshold", type=float, default=0.15, help="slowdown that marks a sibling")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    cpus = sorted(os.sched_getaffinity(0) - {args.cpu})
    rows = []
    for other in cpus:
        alone_before = probe_rate(args.cpu, args.seconds, None)
        loaded = probe_rate(args.cpu, args.seconds, other)
        alone_after = probe_rate(args.cpu, args.seconds, None)
        alone = (alone_before + alone_after) / 2
        rows.append({"cpu": other, "alone": alone, "loaded": loaded, "slowdown": 1 - loaded / alone,
                     "alone_spread": abs(alone_before - alone_after) / alone})
        print(f"load on CPU {other:3d}: probe on CPU {args.cpu} at {loaded / alone:.2f}x of idle "
              f"(idle before / after {alone_before:,.0f} / {alone_after:,.0f} it/s)", flush=True)
    siblings = [r["cpu"] for r in rows if r["slowdown"] > args.threshold]
    kernel = Path(f"/sys/devices/system/cpu/cpu{args.cpu}/topology/thread_siblings_list")
    result = {"cpu": args.cpu, "siblings": siblings, "threshold": args.threshold, "rows": rows,
              "kernel_siblings_list": kernel.read_text().strip() if kernel.exists() else None}
    print(f"CPU {args.cpu}: measured siblings {siblings or 'none'} (slowdown over {args.threshold:.0%}); "
          f"the kernel's list: {result['kernel_siblings_list']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
