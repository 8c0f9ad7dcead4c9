"""Does the gateway's producer process, reading records off its pipe, steal the CPU of the server that
writes them?

A server thread writes ``--rate`` frames/s of ``--frame-bytes`` into a pipe and spends ``--work-ms`` of
CPU between writes (a gateway's event loop answering requests); a child process reads them with the
producer process's own reader (``broker.frame_pipe.FrameReader``), either sleeping in ``select`` whenever
the pipe is empty (``idle_s=0``: every write wakes it) or polling while records flow (the default). A
write that wakes a sleeping reader hints the kernel to run the reader on the writer's CPU, where it can
preempt the writer; a reader under ``SCHED_BATCH`` does not preempt on waking (the kernel leaves batch
tasks to the tick). Reported per mode: the writer's time runnable but off-CPU (/proc schedstat) and how
late its writes were against the schedule; the modes alternate ``--rounds`` times, and the summary is
the ratio of the medians.

    python bench/pipe_wakeup_bench.py            # 500 frames/s of 107 KB, 8 s per run, 2 rounds
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import threading
import time

from gateway_bench import run_delay_seconds  # bench/ is on the path when run as a script

from streamrl.broker.frame_pipe import FRAME, FrameReader, enlarge_pipe
from streamrl.broker.log_producer import background_priority

MODES = {"sleeping reader": (0.0, False), "polling reader": (1.0, False),
         "sleeping reader, SCHED_BATCH": (0.0, True), "polling reader, SCHED_BATCH": (1.0, True)}
"""Each mode: the reader's ``idle_s`` and whether its process runs under ``SCHED_BATCH`` (as the producer
process does: ``broker.log_producer.background_priority``)."""


def _consume(read_fd: int, write_fd: int, idle_s: float, batch: bool) -> None:
    os.close(write_fd)
    if batch:
        background_priority()
    for _ in FrameReader(read_fd, idle_s=idle_s):
        pass


def _run_delay_s() -> float:
    """This thread's time runnable but off a CPU so far."""
    return run_delay_seconds(os.getpid(), threading.get_native_id())


def one_run(idle_s: float, batch: bool, rate: float, seconds: float, frame_bytes: int,
            work_ms: float) -> dict[str, float]:
    read_fd, write_fd = os.pipe()
    enlarge_pipe(write_fd)
    child = multiprocessing.get_context("fork").Process(target=_consume, args=(read_fd, write_fd, idle_s, batch))
    child.start()
    os.close(read_fd)
    payload = b"x" * frame_bytes
    frame = FRAME.pack(len(payload)) + payload
    n_frames = int(rate * seconds)
    late: list[float] = []
    delay0 = _run_delay_s()
    start = time.perf_counter()
    for n in range(n_frames):
        due = start + n / rate
        if (now := time.perf_counter()) < due:
            time.sleep(due - now)
        late.append(time.perf_counter() - due)
        view = memoryview(frame)
        while view:
            view = view[os.write(write_fd, view):]
        busy_until = time.perf_counter() + work_ms / 1000
        while time.perf_counter() < busy_until:
            pass
    delay = _run_delay_s() - delay0
    os.write(write_fd, FRAME.pack(0))
    os.close(write_fd)
    child.join(30)
    late.sort()
    return {"writer_run_delay_ms": delay * 1000, "late_p50_ms": late[len(late) // 2] * 1000,
            "late_p99_ms": late[int(len(late) * 0.99)] * 1000, "late_max_ms": late[-1] * 1000}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=500)
    p.add_argument("--seconds", type=float, default=8)
    p.add_argument("--frame-bytes", type=int, default=107_000)
    p.add_argument("--work-ms", type=float, default=0.6)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode, (idle_s, batch) in MODES.items():
            result = one_run(idle_s, batch, args.rate, args.seconds, args.frame_bytes, args.work_ms)
            runs[mode].append(result)
            print(mode, json.dumps({k: round(v, 2) for k, v in result.items()}), flush=True)
    med = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
    print(f"\n| {os.cpu_count()} cores, {args.rate:g} writes/s of {args.frame_bytes:,} B | writer off-CPU (ms) "
          "| write late p50 / p99 / max (ms) |\n| --- | ---: | --- |")
    for mode, m in med.items():
        print(f"| {mode} | {m['writer_run_delay_ms']:.1f} | "
              f"{m['late_p50_ms']:.2f} / {m['late_p99_ms']:.2f} / {m['late_max_ms']:.2f} |")
    base = med["sleeping reader"]["writer_run_delay_ms"]
    ratio = {mode: base / max(m["writer_run_delay_ms"], 1e-3) for mode, m in med.items()}
    print("\nwriter off-CPU, sleeping reader over: " + ", ".join(f"{mode} {r:.1f}x" for mode, r in ratio.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs, "median": med, "ratio": ratio}, f, indent=2)


if __name__ == "__main__":
    main()
