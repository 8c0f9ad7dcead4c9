"""The producer SDK's own cost: trajectories per second and CPU per trajectory of one asyncio process
(``producers.client.AsyncGateway``: a chat completion and a posted reward per trajectory), through the
real gateway and broker, over an instant stub upstream, so that nothing but the producer and the
gateway bounds it.

Modes, in the same run, same load:

  httpx    the stock ``httpx.AsyncClient`` pool (the baseline: what ``openai.AsyncOpenAI`` uses by default)
  aiohttp  the SDK's default: httpx's API on aiohttp's pool (``httpx-aiohttp``)

    .venv/bin/python bench/producer_bench.py [--concurrency 256] [--seconds 10] [--json FILE]

``--concurrency``: trajectories in flight (the demo keeps ``concurrency x group_size`` of them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gateway_bench as gb
from harness import stamp

from streamrl.producers.client import AsyncGateway

MESSAGES = [{"role": "user", "content": "What is 12 + 7? Answer with just the number."}]


async def load(url: str, mode: str, concurrency: int, seconds: float) -> dict[str, float]:
    limits = httpx.Limits(max_connections=2 * concurrency, max_keepalive_connections=2 * concurrency)
    client = httpx.AsyncClient(timeout=60, limits=limits) if mode == "httpx" else None
    done = failed = 0
    async with AsyncGateway(url, max_connections=2 * concurrency, http_client=client) as gateway:
        deadline = time.monotonic() + seconds

        async def trajectory_loop() -> None:
            nonlocal done, failed
            while time.monotonic() < deadline:
                try:
                    async with gateway.trajectory(group_id="g", group_size=concurrency) as t:
                        await t.client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=16)
                        t.reward(1.0)
                    done += 1
                except Exception:
                    failed += 1

        cpu0, t0 = time.process_time(), time.monotonic()
        await asyncio.gather(*(trajectory_loop() for _ in range(concurrency)))
        wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
    return {"trajectories_per_s": done / wall, "producer_cpu_ms_per_trajectory": cpu * 1000 / max(done, 1),
            "producer_cores": cpu / wall, "failed": failed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--seconds", type=float, default=10)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    from streamrl.broker.embedded import EmbeddedBroker, free_port
    from streamrl.broker.topics import Topics

    results: dict[str, object] = {**stamp(), "concurrency": args.concurrency}
    stub_port, gw_port = free_port(), free_port()
    stub = gb._spawn([sys.executable, gb.__file__, "--serve-stub", str(stub_port)], "stub")
    broker = EmbeddedBroker(topics=Topics("bench")).start()
    procs = [stub]
    try:
        gb._wait_http(f"http://127.0.0.1:{stub_port}/health")
        gw = gb._spawn(gb.gateway_cmd(f"http://127.0.0.1:{stub_port}", gw_port, broker.bootstrap_servers, "on"),
                       "gateway-producer-bench")
        procs.append(gw)
        url = f"http://127.0.0.1:{gw_port}"
        gb._wait_http(f"{url}/health")
        asyncio.run(load(url, "aiohttp", 16, 1.0))  # warm: connections, imports, the broker's first batch
        for mode in ("httpx", "aiohttp"):
            gw_cpu0 = gb.cpu_seconds(gw.pid)
            r = asyncio.run(load(url, mode, args.concurrency, args.seconds))
            r["gateway_cores"] = (gb.cpu_seconds(gw.pid) - gw_cpu0) / args.seconds
            results[mode] = r
            print(f"[{mode}] {json.dumps(r)}", flush=True)
            gb.wait_drained(url)
    finally:
        for proc in procs:
            gb._stop(proc)
        broker.stop()
    base, ours = results["httpx"], results["aiohttp"]  # type: ignore[index]
    results["ratio_trajectories_per_s"] = ours["trajectories_per_s"] / base["trajectories_per_s"]  # type: ignore[index]
    print("\n| pool | trajectories/s | producer CPU ms/trajectory | producer cores | gateway cores | failed |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for mode in ("httpx", "aiohttp"):
        r = results[mode]
        print(f"| {mode} | {r['trajectories_per_s']:.0f} | {r['producer_cpu_ms_per_trajectory']:.2f} "  # type: ignore[index]
              f"| {r['producer_cores']:.2f} | {r['gateway_cores']:.2f} | {r['failed']} |")  # type: ignore[index]
    print(f"\naiohttp pool / httpx pool: {results['ratio_trajectories_per_s']:.2f}x trajectories/s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
