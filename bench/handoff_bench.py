"""What logging a call costs the gateway's event loop itself: the hand-off of a deferred-capture call to the record
producer process (``Proxy._emit_deferred``: the context as JSON, the frame of parts, one ``writev`` into the pipe),
in CPU time of the calling thread per call.

Against a real ``LogProducer`` process (and the embedded broker it delivers to), each mode runs on the same calls'
contexts: ``bare write`` writes a frame of the same size straight into the same pipe (the one system call the
hand-off cannot avoid), ``hand-off`` does what the gateway does. Two paces: ``hot``, bursts of ``--burst`` calls
(a busy event loop, caches warm), and ``cold``, one call every ``--gap-ms`` (an idle one, which pays the cache
misses of code it has not run for a while: in the gateway every call runs cold this way, between the other work
of its request). The modes alternate ``--rounds`` times; reported are the medians and the hand-off's ratio to
the bare write of the same pace.

    python bench/handoff_bench.py            # 3,000 calls per mode and pace, 3 rounds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import types
from collections.abc import Callable

from streamrl.broker.embedded import EmbeddedBroker
from streamrl.broker.frame_pipe import FRAME
from streamrl.broker.log_producer import LogProducer, parts_frame
from streamrl.broker.topics import Topics
from streamrl.gateway.capture import CallContext, engine_parts
from streamrl.gateway.capture_stream import wait_key

TOPIC = "bench.completions"


def contexts(n: int) -> list[CallContext]:
    """Contexts as the gateway makes them for a short chat call (the request is recorded in them)."""
    return [CallContext(trajectory_id=os.urandom(16).hex(), group_id=os.urandom(8).hex(), endpoint="chat",
                        model="policy", policy_name="policy", policy_version=7,
                        request={"model": "policy", "messages": [{"role": "user", "content": f"question {i}"}],
                                 "max_tokens": 1000, "temperature": 0.7},
                        upstream="http://127.0.0.1:8000") for i in range(n)]


def no_records(*_parts: bytes) -> list[tuple[bytes | None, bytes]]:
    """The builder the producer process runs for this bench's frames: nothing to send (the gateway's builder
    would wait there for a capture that never comes here)."""
    return []


def cpu_per_call(calls: list[Callable[[], object]], burst: int, gap_s: float) -> float:
    """Microseconds of this thread's CPU per call, the calls made in bursts of ``burst`` with ``gap_s`` between."""
    total = 0.0
    for i in range(0, len(calls), burst):
        start = time.thread_time()
        for call in calls[i:i + burst]:
            call()
        total += time.thread_time() - start
        time.sleep(gap_s)
    return total / len(calls) * 1e6


def _self() -> types.ModuleType:
    """This module under its own name (run as a script it is ``__main__``, which the producer process cannot
    import a builder from)."""
    import handoff_bench  # bench/ is on the path when run as a script

    return handoff_bench


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--burst", type=int, default=32, help="calls per burst when hot")
    p.add_argument("--gap-ms", type=float, default=0.5, help="pause between calls when cold")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()

    ctxs = contexts(args.calls)
    with EmbeddedBroker(topics=Topics("bench")) as broker:
        build = _self().no_records
        producer = LogProducer(broker.bootstrap_servers, process=True, builders=(build,))
        if not producer.wait_ready(60):
            raise SystemExit("the record producer process did not start")
        pipe = producer._pipe  # the bare write goes into the very pipe the hand-off uses
        assert pipe is not None
        # as Proxy._emit_deferred, the key the context waits for as its last part (here a part like the others)

        def hand_off(ctx: CallContext) -> Callable[[], object]:
            return lambda: producer.offer_parts(TOPIC, build, (engine_parts(ctx, 0.01),
                                                               wait_key(ctx.upstream, "0123456789abcdef")), 1)

        chunks = parts_frame(TOPIC, 0, (engine_parts(ctxs[0], 0.01),
                                                          wait_key(ctxs[0].upstream, "0123456789abcdef")), 1)
        frame = (FRAME.pack(sum(map(len, chunks))), *chunks)

        modes = {"bare write": [lambda: os.writev(pipe.fd, frame)] * args.calls,
                 "hand-off": [hand_off(ctx) for ctx in ctxs]}
        paces = {"hot": (args.burst, 0.005), "cold": (1, args.gap_ms / 1000)}
        runs: dict[str, list[float]] = {f"{m}, {pace}": [] for m in modes for pace in paces}
        for _ in range(args.rounds):
            for pace, (burst, gap_s) in paces.items():
                for mode, calls in modes.items():
                    runs[f"{mode}, {pace}"].append(cpu_per_call(calls, burst, gap_s))
        stats = producer.stats
        producer.close()
    median = {k: statistics.median(v) for k, v in runs.items()}
    ratio = {pace: median[f"hand-off, {pace}"] / median[f"bare write, {pace}"] for pace in paces}
    for key, value in median.items():
        print(f"{key:20s} {value:6.2f} us/call  (rounds: {', '.join(f'{x:.2f}' for x in runs[key])})")
    for pace, value in ratio.items():
        print(f"hand-off / bare write, {pace}: {value:.2f}")
    print(f"records offered {stats.offered}, dropped {stats.dropped}, found the pipe full {stats.waited}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs, "median_us": median, "ratio": ratio,
                       "offered": stats.offered, "dropped": stats.dropped, "waited": stats.waited}, f, indent=2)


if __name__ == "__main__":
    main()
