"""Hot-swap under load: LoRA versions published while clients keep sending requests, in several modes.

  pipeline  the streamrl way: serving never stops; every ``--train-s`` seconds a new version is published
            (training runs elsewhere meanwhile) and the gateway swaps it in under load; a running request
            finishes on the version it started with (the gateway's ``update_mode = "pinned"``).
  pipeline-room  ``pipeline`` with room for one more loaded version (``max_loaded_versions`` 4 against 3): a
            version published while two older ones still run requests loads at once instead of waiting for one of
            them to drain.
  inflight  ``pipeline`` with ``update_mode = "in-flight"``: running requests move to the new version at the
            engine's next step, keeping the KV cache of their tokens so far.
  inflight-recompute  ``inflight`` with ``in_flight_cache = "recompute"``: a moved request is prefilled again
            under the new adapter.
  blocking  imitates the synchronous loop of tools like ART: serve (roll out) for ``--train-s`` seconds,
            then stop accepting requests, let the running ones finish, train (``--train-s``), load the
            new version, resume.

With ``--stream`` the clients stream their answers and the bench reports the cost of a move as the clients
see it: the gaps between an answer's chunks (one decode step each) in the second after each new version is
routed, when the engine moves the running requests, against the gaps elsewhere, per mode; and how many
requests the engine moved (its probe). Each mode runs its own gateway.

Training is imitated by waiting ``--train-s`` seconds in both modes; what is measured is serving. Real
parts otherwise: the embedded broker, a vLLM server on the tiny model (started here unless
``--upstream`` is given), the gateway (``streamrl gateway``, its own process) and real peft adapters.
Reported per mode: failed requests, requests that waited for a swap, latency p50/p99 in steady state
and around swaps, delay from publish to the first request served by the new version (p50/p99), and
serving time lost per training step; from the gateway's log, each version's publish -> served and the versions
that waited for room (``gateway_publish_to_served``).

    .venv/bin/python bench/hotswap_bench.py [--versions 10] [--train-s 2] [--clients 4] [--max-tokens 16]
        [--logs DIR]  (keep the gateway's and the engine's logs: the swap lines give received / verified / loaded)
    .venv/bin/python bench/hotswap_bench.py --modes pipeline,inflight,inflight-recompute --stream --max-tokens 512
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
import numpy as np
from harness import stamp
from swap_log import publish_to_served

NAME = "policy"
CHAT = [{"role": "user", "content": "Tell me about the sea."}]


DEFAULT_ROOM = ("--max-loaded-versions", "3")
"""The gateway's default room: the routed version, the one kept before it, the next one."""
MODES = {"pipeline": DEFAULT_ROOM, "pipeline-room": ("--max-loaded-versions", "4"),
         "inflight": (*DEFAULT_ROOM, "--update-mode", "in-flight"),
         "inflight-recompute": (*DEFAULT_ROOM, "--update-mode", "in-flight", "--in-flight-cache", "recompute"),
         "blocking": DEFAULT_ROOM}
"""Each mode's gateway flags. ``pipeline-room`` is the pinned mode's own remedy for a version that waits for an
older one to drain (requests still running on it): room for one more loaded version."""
AROUND_MOVE_S = 1.0
"""With --stream: chunk gaps ending this long after a version is routed count as around its swap."""


@dataclass
class Sample:
    start: float
    end: float
    status: int
    version: int
    waited: float
    """Seconds the request was held before it could be sent (blocking mode's pause)."""
    chunks: list[float] | None = None
    """With --stream: when each chunk of the answer arrived."""
    error: str | None = None
    """Why the request failed: its status and body, the client's exception, or a stream's error event or missing
    end (a streamed answer's status is sent before its first token, so 200 alone does not say it ended well)."""

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


async def client_loop(session: aiohttp.ClientSession, url: str, gate: asyncio.Event, stop: asyncio.Event,
                      samples: list[Sample], in_flight: list[int], max_tokens: int, stream: bool = False,
                      seed: int = 0) -> None:
    """One client, sending the next request as soon as the last one ended. Streamed answers run to a length
    drawn between half ``max_tokens`` and all of it (``ignore_eos``): long enough to be running at a swap, and
    unequal, so that the clients do not end in the same step (then every request after a swap would start on
    the new version, and nothing would be left to move)."""
    rng = random.Random(seed)
    body = {"model": NAME, "messages": CHAT, "max_tokens": max_tokens, "temperature": 1.0, "stream": stream}
    while not stop.is_set():
        if stream:
            body.update(ignore_eos=True, max_tokens=rng.randint(max(1, max_tokens // 2), max_tokens))
        ready = time.perf_counter()
        await gate.wait()
        start = time.perf_counter()
        in_flight[0] += 1
        chunks: list[float] | None = [] if stream else None
        error = None
        try:
            async with session.post(url, json=body) as r:
                status, version = r.status, int(r.headers.get("x-policy-version", -1))
                if chunks is None or status != 200:
                    text = await r.read()
                    error = None if status == 200 else f"HTTP {status}: {text[:200].decode(errors='replace')}"
                else:
                    ended = False
                    async for line in r.content:
                        if line.startswith(b'data: {"error"'):  # vLLM's ErrorResponse, as a stream sends it
                            error = f"error event: {line[6:206].decode(errors='replace').strip()}"
                        elif line.startswith(b"data: {"):
                            chunks.append(time.perf_counter())
                        ended |= line.startswith(b"data: [DONE]")
                    if not ended and error is None:
                        error = "stream ended without [DONE]"
        except aiohttp.ClientError as e:
            status, version, error = 0, -1, f"{type(e).__name__}: {e}"[:200]
        finally:
            in_flight[0] -= 1
        samples.append(Sample(start, time.perf_counter(), status, version, start - ready, chunks, error))


def gateway_version(gw: str) -> int:
    return httpx.get(f"{gw}/health", timeout=5).json()["policy"]["version"]


async def wait_version(gw: str, version: int, timeout: float = 60) -> float:
    """When the gateway first said it routes ``version``. A poll that gets no answer in time is tried again: on a
    host whose CPUs the engine fills (vLLM's CPU build), the gateway can be slow to accept one."""
    deadline = time.perf_counter() + timeout
    async with httpx.AsyncClient(timeout=10) as http:
        while time.perf_counter() < deadline:
            try:
                if (await http.get(f"{gw}/health")).json()["policy"]["version"] >= version:
                    return time.perf_counter()
            except httpx.TransportError:
                continue
            await asyncio.sleep(0.005)
    raise TimeoutError(f"version {version} not routed")


def moves(upstream: str) -> int:
    """Requests the engine has moved to a newer version so far (its capture probe; 0 without one)."""
    r = httpx.get(f"{upstream}/streamrl/capture", timeout=5)
    return int(r.json().get("in_flight_moves", 0)) if r.status_code == 200 else 0


def chunk_gaps(samples: list, routed_at: list[float]) -> dict[str, float | int | None]:
    """Gaps between consecutive chunks of the streamed answers (one decode step each, as the client sees it),
    split by whether a gap ended within ``AROUND_MOVE_S`` after a version was routed: p50 / p99 / max of each
    set, in ms, and their counts."""
    steady, around = [], []
    for s in samples:
        if not s.ok or not s.chunks or len(s.chunks) < 2:
            continue
        ends = np.asarray(s.chunks[1:])
        gaps = np.diff(np.asarray(s.chunks)) * 1000
        near = np.zeros(len(ends), bool)
        for t in routed_at:
            near |= (ends >= t) & (ends < t + AROUND_MOVE_S)
        around.append(gaps[near])
        steady.append(gaps[~near])
    out: dict[str, float | int | None] = {}
    for name, parts in (("steady", steady), ("around_swap", around)):
        a = np.concatenate(parts) if parts else np.zeros(0)
        out[f"chunk_gap_{name}_n"] = int(a.size)
        for label, q in (("p50", 50), ("p99", 99), ("max", 100)):
            out[f"chunk_gap_{name}_{label}_ms"] = float(np.percentile(a, q)) if a.size else None
    return out


async def run_mode(mode: str, gw: str, publish, first_version: int, args: argparse.Namespace) -> dict[str, object]:
    samples: list[Sample] = []
    in_flight = [0]
    gate, stop = asyncio.Event(), asyncio.Event()
    gate.set()
    published: dict[int, float] = {}
    pauses: list[float] = []
    routed: dict[int, float] = {}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        url = f"{gw}/v1/chat/completions"
        clients = [asyncio.create_task(client_loop(session, url, gate, stop, samples, in_flight, args.max_tokens,
                                                   args.stream, seed=first_version * 1000 + i))
                   for i in range(args.clients)]
        await asyncio.sleep(args.warmup_s)
        t_begin = time.perf_counter()
        for i in range(args.versions):
            version = first_version + i
            if mode != "blocking":
                await asyncio.sleep(args.train_s)  # the trainer works elsewhere; serving goes on
                published[version] = await asyncio.to_thread(publish, version)
                routed[version] = await wait_version(gw, version) - published[version]
            else:
                await asyncio.sleep(args.train_s)  # roll out (serve) as long as a training step takes
                paused = time.perf_counter()
                gate.clear()  # stop serving
                while in_flight[0]:  # let the running requests finish
                    await asyncio.sleep(0.001)
                await asyncio.sleep(args.train_s)  # train
                published[version] = await asyncio.to_thread(publish, version)  # swap
                routed[version] = await wait_version(gw, version) - published[version]
                gate.set()  # resume
                pauses.append(time.perf_counter() - paused)
        await asyncio.sleep(args.train_s / 2)
        t_end = time.perf_counter()
        stop.set()
        gate.set()
        await asyncio.gather(*clients)

    samples = [s for s in samples if s.start >= t_begin - args.warmup_s / 2]
    failures = Counter(s.error for s in samples if not s.ok)
    waited = [s for s in samples if s.waited > 0.001]
    first_served = {}
    for v, t_pub in published.items():
        starts = [s.start for s in samples if s.version == v and s.ok]
        if starts:
            first_served[v] = min(starts) - t_pub
    windows = [(published[v], published[v] + first_served.get(v, 0) + 0.5) for v in published]

    def in_window(s: Sample) -> bool:
        return any(s.start < b and s.end > a for a, b in windows)

    lat = lambda xs: np.asarray([(s.end - s.start) * 1000 for s in xs])  # noqa: E731
    steady = lat([s for s in samples if not in_window(s) and s.ok])
    around = lat([s for s in samples if in_window(s) and s.ok])
    delays = np.asarray(list(first_served.values())) * 1000
    span = t_end - t_begin
    ok = [s for s in samples if s.ok and t_begin <= s.start <= t_end]

    def pct(a: np.ndarray, q: float) -> float | None:
        return float(np.percentile(a, q)) if a.size else None

    print("per version (publish->routed, publish->first served) ms:",
          {v: (round(routed[v] * 1000), round(first_served[v] * 1000) if v in first_served else None) for v in published})
    return {
        "mode": mode, "versions": len(published), "requests": len(samples), "failed": sum(failures.values()),
        "failure_kinds": dict(failures.most_common(5)),
        "waited_for_swap": len(waited), "mean_wait_ms": float(np.mean([s.waited for s in waited]) * 1000) if waited else 0.0,
        "versions_seen": sorted({s.version for s in samples}),
        "latency_steady_p50_ms": pct(steady, 50), "latency_steady_p99_ms": pct(steady, 99),
        "latency_around_swap_p50_ms": pct(around, 50), "latency_around_swap_p99_ms": pct(around, 99),
        "publish_to_routed_p50_ms": pct(np.asarray(list(routed.values())) * 1000, 50),
        "publish_to_routed_p99_ms": pct(np.asarray(list(routed.values())) * 1000, 99),
        "publish_to_first_served_p50_ms": pct(delays, 50), "publish_to_first_served_p99_ms": pct(delays, 99),
        "serving_time_lost_per_step_s": float(np.mean(pauses)) if pauses else 0.0,
        "throughput_rps": len(ok) / span,
        **(chunk_gaps(samples, [published[v] + routed[v] for v in published]) if args.stream else {}),
    }


def unload_all(upstream: str, name: str) -> None:
    with contextlib.suppress(httpx.HTTPError):
        for card in httpx.get(f"{upstream}/v1/models").json()["data"]:
            if card["id"].startswith(f"{name}@v"):
                httpx.post(f"{upstream}/v1/unload_lora_adapter", json={"lora_name": card["id"]})


def stop_gateway(gateway: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(gateway.pid, signal.SIGTERM)
    gateway.wait(30)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--versions", type=int, default=10)
    p.add_argument("--train-s", type=float, default=2.0)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--warmup-s", type=float, default=3.0)
    p.add_argument("--upstream", help="use this running vLLM server (started with streamrl engine) instead")
    p.add_argument("--model", help="its model directory (default: build the tiny model)")
    p.add_argument("--modes", default="pipeline,blocking", help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--stream", action="store_true",
                   help="clients stream (answers of half --max-tokens to all of it): report chunk gaps around each swap")
    p.add_argument("--json", type=Path)
    p.add_argument("--logs", type=Path, help="keep the gateway's and the engine's logs here")
    args = p.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        p.error(f"--modes must name some of {', '.join(MODES)}, not {args.modes!r}")

    from streamrl.broker.embedded import EmbeddedBroker, free_port
    from streamrl.broker.policy_log import PolicyLog, adapter_record
    from streamrl.broker.topics import Topics
    from streamrl.child import wait_http
    from streamrl.engine.server import Engine, EngineConfig
    from streamrl.tiny_model import build_model, random_adapter

    work = Path(tempfile.mkdtemp(prefix="hotswap-bench-"))
    engine = gateway = upstream = None
    broker = EmbeddedBroker(topics=Topics("hsbench")).start()
    try:
        model = Path(args.model) if args.model else build_model(work / "model", "tiny", seed=0)
        if args.upstream:
            upstream = args.upstream.rstrip("/")
        else:
            print("starting vLLM ...", flush=True)
            engine = Engine(EngineConfig(model=str(model), max_loras=4, max_cpu_loras=8,
                                         max_model_len=max(1024, args.max_tokens + 64)),
                            log_file=work / "engine.log").start()
            upstream = engine.url
        base_model = httpx.get(f"{upstream}/v1/models").json()["data"][0]["id"]
        print("writing adapters ...", flush=True)
        distinct = [random_adapter(model, work / "distinct" / str(i), seed=i) for i in range(3)]

        policy_log = PolicyLog(broker.bootstrap_servers, Topics("hsbench"))

        def publish(version: int) -> float:
            """Write the version's directory, publish it; returns when the record was sent."""
            path = work / "adapters" / f"v{version}"
            shutil.copytree(distinct[version % len(distinct)], path)  # every version its own directory
            record = policy_log.publish(adapter_record(NAME, version, path, base_model))
            return time.perf_counter() - (time.time() - record.created)

        def start_gateway(mode: str) -> tuple[subprocess.Popen, str]:
            """The mode's own gateway, healthy, serving the newest version published."""
            port = free_port()
            log = (work / f"gateway-{mode}.log").open("wb")
            proc = subprocess.Popen(
                [sys.executable, "-m", "streamrl.cli", "--log-level", "INFO", "gateway", "--upstream", upstream,
                 "--bootstrap-servers", broker.bootstrap_servers, "--port", str(port), "--topic-prefix", "hsbench",
                 "--policy-name", NAME, *MODES[mode]], start_new_session=True,
                stdout=log, stderr=subprocess.STDOUT)
            url = f"http://127.0.0.1:{port}"
            wait_http(url, 60, what="gateway", interval=0.1)
            return proc, url

        results = {**stamp(),
                   "args": {k: v for k, v in vars(args).items() if k not in ("json", "logs")}}
        # warm-up: the first adapter a fresh engine serves costs seconds once (LoRA set-up); not measured
        publish(1)
        next_version = 2
        for mode in modes:
            gateway, gw = start_gateway(mode)
            asyncio.run(wait_version(gw, next_version - 1))
            httpx.post(f"{gw}/v1/chat/completions", json={"model": NAME, "messages": CHAT, "max_tokens": 4},
                       timeout=120)
            print(f"[{mode}] {args.versions} versions, {args.clients} clients ...", flush=True)
            moved = moves(upstream)
            r = asyncio.run(run_mode(mode, gw, publish, next_version, args))
            r["requests_moved"] = moves(upstream) - moved
            stop_gateway(gateway)
            gateway = None
            unload_all(upstream, NAME)  # the next mode's gateway starts from the engine's base alone
            r["gateway_publish_to_served"] = publish_to_served(work / f"gateway-{mode}.log",
                                                               range(next_version, next_version + args.versions))
            next_version += args.versions
            results[mode] = r
            print(json.dumps(r), flush=True)
        print(json.dumps(results, indent=2))
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
    finally:
        if gateway is not None:
            stop_gateway(gateway)
        if engine is None and upstream is not None:  # an engine must never outlive the files of its adapters
            unload_all(upstream, NAME)
        if engine is not None:
            engine.stop()
        broker.stop()
        if args.logs:
            args.logs.mkdir(parents=True, exist_ok=True)
            for log in [*work.glob("gateway-*.log"), work / "engine.log"]:
                if log.exists():
                    shutil.copy(log, args.logs / log.name)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
