"""Event-loop lag: how late a periodic timer on the gateway's event loop runs.

A request's added latency includes every moment the loop spends on something else (a long
synchronous call, a collection, another thread holding the GIL). A callback that asks to run again
``interval_s`` after each run and records how late it actually ran sees those stalls without touching
the request path, on any host. uvloop's timers have 1 ms resolution, so lags under about 1 ms are the
timer's own granularity; the tail is what this is for.

Cost: one timer callback and one histogram observation per interval (docs/gateway.md, "Metrics").
"""

from __future__ import annotations

import asyncio
import bisect
import gc
import time
from collections.abc import Callable

LAG_BUCKETS = (0.0005, 0.001, 0.0015, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.025,
               0.03, 0.04, 0.05, 0.075, 0.1)
"""Fine from 0.5 ms (the timer's floor) to 100 ms: a 5 ms GIL switch interval and its multiples are
told apart."""


class LoopLagMonitor:
    """``start()`` on the loop to watch; every ``interval_s`` it passes the lateness to ``observe``."""

    def __init__(self, observe: Callable[[float], None], interval_s: float = 0.005) -> None:
        self.observe = observe
        self.interval_s = interval_s
        self.samples = 0
        """Samples taken so far (tests await one more after stalling the loop)."""
        self.loop: asyncio.AbstractEventLoop | None = None
        self._due = 0.0
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """Start on the running loop."""
        self.loop = asyncio.get_running_loop()
        self._schedule(time.perf_counter())

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _schedule(self, now: float) -> None:
        assert self.loop is not None
        self._due = now + self.interval_s
        self._handle = self.loop.call_later(self.interval_s, self._tick)

    def _tick(self) -> None:
        now = time.perf_counter()
        lag = max(0.0, now - self._due)
        self.samples += 1
        self.observe(lag)
        self._schedule(now)


class CollectionPauses:
    """How long each garbage collection of this process took, by generation: a collection holds the GIL,
    so the event loop waits it out whichever thread set it off, and the lag monitor alone cannot say that a
    stall was one. ``install()`` adds a ``gc.callbacks`` entry; the callback only counts into plain lists
    (no lock: a collection may start inside any code, a metrics lock held by the same thread included), and
    ``buckets()`` hands the counts to a collector at scrape time."""

    def __init__(self, bounds: tuple[float, ...] = LAG_BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [[0] * (len(bounds) + 1) for _ in range(3)]
        """Per generation, collections per bucket (the last: over every bound)."""
        self.sums = [0.0, 0.0, 0.0]
        self._started = 0.0

    def install(self) -> None:
        if self._on_collection not in gc.callbacks:
            gc.callbacks.append(self._on_collection)

    def uninstall(self) -> None:
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)

    def _on_collection(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        if not self._started:  # installed during a collection
            return
        took = time.perf_counter() - self._started
        generation = info["generation"]
        self.counts[generation][bisect.bisect_left(self.bounds, took)] += 1
        self.sums[generation] += took

    def buckets(self, generation: int) -> tuple[list[tuple[str, float]], float]:
        """Cumulative ``(le, count)`` pairs as Prometheus writes them, and the sum of seconds."""
        out, total = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts[generation], strict=True):
            total += count
            out.append(("+Inf" if bound == float("inf") else repr(bound), float(total)))
        return out, self.sums[generation]
