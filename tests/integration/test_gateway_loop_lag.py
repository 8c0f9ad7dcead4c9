"""The event-loop lag monitor: a stall of the loop shows up as a late sample, in the gateway's /metrics too."""

from __future__ import annotations

import asyncio
import gc
import time

import httpx
import uvloop

from streamrl.broker.embedded import free_port
from streamrl.gateway.config import GatewayConfig
from streamrl.gateway.loop_lag import CollectionPauses, LoopLagMonitor
from streamrl.gateway.server import GatewayServer

STALL_S = 0.08
LAG_METRIC = "streamrl_gateway_event_loop_lag_seconds"


def test_a_blocked_loop_gives_a_late_sample() -> None:
    async def scenario() -> list[float]:
        samples: list[float] = []
        sampled = asyncio.Event()

        def observe(lag: float) -> None:
            samples.append(lag)
            sampled.set()

        monitor = LoopLagMonitor(observe, interval_s=0.005)
        monitor.start()
        await sampled.wait()  # the timer runs
        sampled.clear()
        time.sleep(STALL_S)  # the stall under test: a blocking call on the loop
        await sampled.wait()
        monitor.stop()
        return samples

    samples = uvloop.run(scenario())
    # the sample after the stall was due 5 ms after the one before it, so it is at least STALL_S - 5 ms late
    assert samples[-1] >= STALL_S - 0.005 - 0.001, samples


def _buckets(text: str) -> dict[str, float]:
    prefix = LAG_METRIC + '_bucket{le="'
    return {line[len(prefix):].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(prefix)}


def test_gateway_exports_the_lag_of_its_loop() -> None:
    config = GatewayConfig(upstreams=(f"http://127.0.0.1:{free_port()}",), port=free_port())
    with GatewayServer(config) as gw:
        monitor = gw.gateway.loop_lag
        assert monitor.loop is not None, "the monitor did not start with the gateway"

        async def stall() -> None:
            before = monitor.samples
            time.sleep(STALL_S)  # block the gateway's own loop
            while monitor.samples == before:  # yield until the overdue timer has run
                await asyncio.sleep(0)

        asyncio.run_coroutine_threadsafe(stall(), monitor.loop).result(timeout=30)
        buckets = _buckets(httpx.get(f"{gw.url}/metrics", timeout=10).text)
    assert "0.0005" in buckets and "0.1" in buckets, buckets
    assert buckets["+Inf"] - buckets["0.05"] >= 1, buckets  # at least one sample later than 50 ms
    assert buckets["+Inf"] >= 2, buckets


GC_METRIC = "streamrl_gateway_gc_pause_seconds"


def test_a_collection_is_timed_by_generation() -> None:
    pauses = CollectionPauses()
    pauses.install()
    try:
        garbage = [[i] for i in range(200_000)]  # something for the full collection to walk
        gc.collect(2)
        del garbage
    finally:
        pauses.uninstall()
    buckets, seconds = pauses.buckets(2)
    assert buckets[-1] == ("+Inf", float(sum(pauses.counts[2])))
    assert sum(pauses.counts[2]) >= 1 and seconds > 0
    assert [count for _, count in buckets] == sorted(count for _, count in buckets)  # cumulative
    calls = len(gc.callbacks)
    gc.collect(2)
    assert len(gc.callbacks) == calls and sum(pauses.counts[2]) == buckets[-1][1]  # uninstalled: not counted


def test_gateway_exports_its_collections() -> None:
    config = GatewayConfig(upstreams=(f"http://127.0.0.1:{free_port()}",), port=free_port())
    with GatewayServer(config) as gw:
        before = gw.gateway.gc_pauses.counts[2][:]
        gc.collect(2)  # the gateway runs in this process: its callback times this collection
        text = httpx.get(f"{gw.url}/metrics", timeout=10).text
    full = {line.split('le="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(GC_METRIC + '_bucket{generation="2"')}
    assert full["+Inf"] >= sum(before) + 1, full
    assert f'{GC_METRIC}_sum{{generation="0"}}' in text
