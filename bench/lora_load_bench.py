"""Loading adapter versions into a running engine: how long each load takes, and how long generation stops.

Publish -> served is bounded by vLLM's ``load_lora_adapter`` once the gateway has checked the record (the
record arrives in ~10 ms, its sha256 takes tens of ms: docs/benchmarks.md, "Hot-swap under load"), and a
load runs in the engine core's one thread between two steps, so while it runs no request in flight gets a
token. This bench measures both, for adapters of the shape the trainer publishes (its own
``attach_lora`` + ``write_adapter``: peft's files, all linear layers, in the base model's dtype), the way
the gateway drives the engine (each version under its own name, the version two back unloaded once no
request uses it), in phases that share ``--versions`` equally:

  idle        loads with nothing generating
  busy        loads while ``--streams`` streamed chat requests generate without pause (``ignore_eos``), each
              on the newest loaded version, as the gateway routes them; a load every ``--interval-s``
  shared-gpu  (``--gpu-neighbour``) the same beside a process that keeps the GPU busy with bf16 matmuls, as a
              trainer sharing it does (the one-GPU layout)

Per load: the HTTP call's time (``load_ms``) and the longest stretch in which no stream received a token
while the load ran (``pause_ms``), against the longest such stretch in windows of the same length between
loads (``quiet_gap_ms``: what a step leaves anyway). ``--py-spy`` samples the engine's processes during each
loading phase and counts, of the samples inside vLLM's ``add_lora``, those in each of its parts (reading the
files, pinning host memory, packing q/k/v and gate/up, copying into the GPU slots, on the CPU build the
engine core waiting for its worker process).

    .venv/bin/python bench/lora_load_bench.py [--shape qwen2.5-1.5b | --model DIR] [--rank 16] [--versions 12]
        [--streams 64] [--max-tokens 512] [--interval-s 1.5] [--gpu-neighbour] [--py-spy] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import numpy as np
from harness import stamp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

NAME = "policy"
ADD_LORA_PARTS = {  # a frame's function name -> the part of a load it is (first match from the leaf wins)
    "from_local_checkpoint": "read files", "_load_adapter": "read files", "pin_memory": "pin host memory",
    "from_lora_tensors": "cast and pin each tensor", "_create_merged_loras_inplace": "pack q/k/v, gate/up",
    "optimize": "scale lora_B (none when the scaling is 1: trainer/publish.py folds it in)",
    "set_lora": "copy into GPU slots", "reset_lora": "copy into GPU slots", "activate_adapter": "copy into GPU slots",
    "remove_oldest_adapter": "evict", "remove_adapter": "evict",
    "_wait_for_response": "engine core waits for its worker process", "call_utility_async": "API server's call",
}


def write_versions(model_dir: str, out: Path, versions: int, rank: int) -> list[Path]:
    """``versions`` adapters as the trainer publishes them, each with its own random B matrices."""
    import torch
    from transformers import AutoModelForCausalLM

    from streamrl.trainer.config import TrainerConfig
    from streamrl.trainer.model import attach_lora
    from streamrl.trainer.publish import version_dirs, write_adapter

    have = version_dirs(out)
    if all(v in have for v in range(1, versions + 1)):
        return [have[v] for v in range(1, versions + 1)]
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    model = attach_lora(base, TrainerConfig.load(None, model=model_dir, lora_rank=rank, lora_alpha=2.0 * rank))
    dirs = []
    for v in range(1, versions + 1):
        torch.manual_seed(v)
        with torch.no_grad():
            for pname, param in model.named_parameters():
                if "lora_B" in pname:
                    param.normal_(0.0, 0.01)
        dirs.append(write_adapter(model, out, v, {"bench": "lora_load"})[0])
    return dirs


def gpu_neighbour(seconds: float) -> None:
    """Keep the GPU busy like a trainer's step (bf16 matmuls of 8k x 8k) for ``seconds``."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end, ready = time.monotonic() + seconds, False
    while time.monotonic() < end:
        for _ in range(20):
            a = (a @ b).clamp_(-1, 1)
        torch.cuda.synchronize()
        if not ready:
            print("ready", flush=True)
            ready = True


class Versions:
    """What the gateway does with versions: the newest takes new requests, the one two back is unloaded
    once no request runs on it."""

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session, self.url = session, url
        self.newest: str | None = None
        self.in_use: collections.Counter[str] = collections.Counter()
        self.retiring: list[str] = []
        self.loaded: list[str] = []
        self.unload_ms: list[float] = []

    async def load(self, name: str, path: Path) -> float:
        start = time.perf_counter()
        async with self.session.post(f"{self.url}/v1/load_lora_adapter",
                                     json={"lora_name": name, "lora_path": str(path)}) as r:
            text = await r.text()
            if r.status != 200:
                raise RuntimeError(f"load {name}: {r.status} {text[:300]}")
        took = time.perf_counter() - start
        self.newest = name
        self.loaded.append(name)
        if len(self.loaded) > 2:
            self.retiring.append(self.loaded.pop(0))
        await self.unload_idle()
        return took

    async def unload_idle(self) -> None:
        for name in [n for n in self.retiring if not self.in_use[n]]:
            if name not in self.retiring:  # another caller took it while this one awaited an unload
                continue
            self.retiring.remove(name)
            start = time.perf_counter()
            async with self.session.post(f"{self.url}/v1/unload_lora_adapter", json={"lora_name": name}) as r:
                text = await r.text()
                if r.status != 200:
                    raise RuntimeError(f"unload {name}: {r.status} {text[:300]}")
            self.unload_ms.append((time.perf_counter() - start) * 1000)


async def stream_forever(versions: Versions, stop: asyncio.Event, arrivals: list[float], max_tokens: int,
                         seed: int) -> None:
    """Streamed chat on the newest version, one request after another; the time of every token chunk."""
    while not stop.is_set():
        name = versions.newest
        assert name is not None
        versions.in_use[name] += 1
        body = {"model": name, "messages": [{"role": "user", "content": f"Tell me a story, number {seed}."}],
                "max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True, "stream": True}
        try:
            async with versions.session.post(f"{versions.url}/v1/chat/completions", json=body) as r:
                if r.status != 200:
                    raise RuntimeError(f"stream on {name}: {r.status} {(await r.text())[:300]}")
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        arrivals.append(time.perf_counter())
        finally:
            versions.in_use[name] -= 1
        await versions.unload_idle()


def longest_gap(times: np.ndarray, start: float, end: float) -> float:
    """The longest stretch overlapping [start, end] in which no token arrived (``times`` sorted)."""
    i = max(int(np.searchsorted(times, start)) - 1, 0)
    j = min(int(np.searchsorted(times, end)) + 1, len(times))
    window = times[i:j]
    return float(np.diff(window).max()) if len(window) > 1 else float("nan")


def pauses(arrivals: list[float], loads: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """Per load, the longest gap while it ran; and the longest gap of as many windows of the same length
    placed between loads (what generation's own steps leave, the baseline)."""
    times = np.sort(np.asarray(arrivals))
    during = [longest_gap(times, s, e) * 1000 for s, e in loads]
    quiet = []
    length = float(np.median([e - s for s, e in loads]))
    for (_, prev_end), (next_start, _) in itertools.pairwise(loads):
        mid = (prev_end + next_start) / 2
        if next_start - prev_end > length + 0.2:
            quiet.append(longest_gap(times, mid - length / 2, mid + length / 2) * 1000)
    return during, quiet


def add_lora_breakdown(raw: Path) -> dict[str, Any]:
    """Of py-spy's collapsed stacks, the samples inside ``add_lora`` and their split into a load's parts."""
    parts: collections.Counter[str] = collections.Counter()
    total = inside = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        total += n
        functions = [frame.split(" (", 1)[0].rsplit(".", 1)[-1] for frame in stack.split(";")]
        if "add_lora" not in functions:
            continue
        inside += n
        part = next((ADD_LORA_PARTS[f] for f in reversed(functions) if f in ADD_LORA_PARTS), "other")
        parts[part] += n
    return {"samples": total, "in_add_lora": inside, "parts": dict(parts.most_common())}


def summary(values: list[float]) -> dict[str, float]:
    a = np.asarray([v for v in values if v == v])
    if not len(a):
        return {}
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)), "max": float(a.max()), "n": len(a)}


async def run(args: argparse.Namespace, url: str, dirs: list[Path], engine_pid: int) -> dict[str, Any]:
    """The phases in turn, each loading its share of the versions: idle, busy and (``--gpu-neighbour``)
    busy beside a process holding the same GPU."""
    from capture_bench import finish_py_spy, start_py_spy

    phases = ["idle", "busy"] + (["shared-gpu"] if args.gpu_neighbour else [])
    share = len(dirs) // len(phases)
    result: dict[str, Any] = {"phases": {}}
    # No connection limit (aiohttp's default is 100): with --streams past it, the loads waited for a stream to
    # finish (the 2026-12-02 H200 run: loads of 1-9 s with 43 py-spy samples in add_lora); the gateway's own pool
    # has no limit either.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        versions = Versions(session, url)
        stop, arrivals = asyncio.Event(), []
        streams: list[asyncio.Task[None]] = []
        neighbour = None
        try:
            for i, phase in enumerate(phases):
                todo = range(i * share + 1, (i + 1) * share + 1)
                if phase == "idle":
                    loads = [await versions.load(f"{NAME}@v{v}", dirs[v - 1]) * 1000 for v in todo]
                    result["phases"][phase] = {"load_ms": loads, "summary": {"load_ms": summary(loads)}}
                    continue
                if not streams:
                    streams = [asyncio.create_task(stream_forever(versions, stop, arrivals, args.max_tokens, n))
                               for n in range(args.streams)]
                    while len(arrivals) < args.streams * 8 and not any(t.done() for t in streams):
                        await asyncio.sleep(0.1)  # every stream past its prefill
                if phase == "shared-gpu":
                    neighbour = await asyncio.create_subprocess_exec(
                        sys.executable, __file__, "--neighbour", "3600", stdout=subprocess.PIPE)
                    assert neighbour.stdout is not None
                    if await neighbour.stdout.readline() != b"ready\n":  # busy from here on
                        raise RuntimeError("the GPU neighbour did not start (no CUDA device?)")
                await asyncio.sleep(args.interval_s)
                profiler = None
                if args.py_spy:
                    seconds = len(todo) * (args.interval_s + 1) + 2
                    profiler = start_py_spy(engine_pid, SimpleNamespace(out=args.out, py_spy=seconds), f"lora-{phase}")
                started, chunks_before = time.perf_counter(), len(arrivals)
                loads, windows = [], []
                for v in todo:
                    s = time.perf_counter()
                    loads.append(await versions.load(f"{NAME}@v{v}", dirs[v - 1]) * 1000)
                    windows.append((s, time.perf_counter()))
                    await asyncio.sleep(args.interval_s)
                seconds = time.perf_counter() - started
                during, quiet = pauses(arrivals, windows)
                entry: dict[str, Any] = {
                    "load_ms": loads, "pause_ms": during, "quiet_gap_ms": quiet,
                    "stream_chunks_per_s": (len(arrivals) - chunks_before) / seconds,
                    "summary": {"load_ms": summary(loads), "pause_ms": summary(during),
                                "quiet_gap_ms": summary(quiet)}}
                if profiler is not None:
                    entry["py_spy"] = finish_py_spy(profiler)
                    raw = Path(entry["py_spy"]["file"])
                    if raw.exists():
                        entry["add_lora"] = add_lora_breakdown(raw)
                result["phases"][phase] = entry
        finally:
            stop.set()
            for t in streams:
                t.cancel()
            if neighbour is not None:
                neighbour.kill()
                await neighbour.wait()
            failed = [t.exception() for t in streams if t.done() and not t.cancelled() and t.exception()]
    if failed:
        raise RuntimeError(f"a stream failed: {failed[0]}")
    result["unload_ms"] = summary(versions.unload_ms)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a checkpoint directory (default: build a random one of --shape, bf16)")
    p.add_argument("--shape", default="qwen2.5-1.5b")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--versions", type=int, default=12, help="adapter versions, shared equally by the phases")
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--interval-s", type=float, default=1.5, help="pause between two loads under load")
    p.add_argument("--gpu-neighbour", action="store_true", help="keep the engine's GPU busy from another process")
    p.add_argument("--py-spy", action="store_true", help="profile the engine during the busy loads (py-spy on PATH)")
    p.add_argument("--engine-args", default="", help="extra vLLM flags")
    p.add_argument("--gpu-memory-utilization", type=float, help="vLLM's share of the GPU (room for a neighbour)")
    p.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "lora-load-bench")
    p.add_argument("--json", type=Path)
    p.add_argument("--neighbour", type=float, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.neighbour:
        gpu_neighbour(args.neighbour)
        return 0
    if args.versions < 3 * (3 if args.gpu_neighbour else 2):
        p.error("--versions: at least 3 per phase")

    from streamrl.engine.server import Engine, EngineConfig

    args.out.mkdir(parents=True, exist_ok=True)
    if args.model is None:
        from streamrl.tiny_model import build_model

        model_dir = args.out / f"model-{args.shape}"
        if not (model_dir / "config.json").exists():
            build_model(model_dir, args.shape, seed=0, dtype="bfloat16")
        args.model = str(model_dir)
    started = time.monotonic()
    dirs = write_versions(args.model, args.out / "adapters" / f"{args.shape}-r{args.rank}", args.versions, args.rank)
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()},
                               **stamp(),
                               "adapter_mb": sum(f.stat().st_size for f in dirs[0].iterdir()) / 1e6,
                               "adapters_written_s": time.monotonic() - started}
    engine = Engine(EngineConfig(model=args.model, max_model_len=2048, max_lora_rank=args.rank,
                                 gpu_memory_utilization=args.gpu_memory_utilization,
                                 extra_args=args.engine_args.split()), log_file=args.out / "engine.log")
    started = time.monotonic()
    engine.start(timeout=900)
    results["engine_start_s"] = time.monotonic() - started
    try:
        import vllm

        results["vllm"] = vllm.__version__
        results.update(asyncio.run(run(args, engine.url, dirs, engine.proc.pid)))
    finally:
        engine.stop()
    for phase, entry in results["phases"].items():
        figures = {k: {q: round(v, 1) for q, v in s.items()} for k, s in entry["summary"].items()}
        print(f"[{phase}] {json.dumps(figures)}")
        if "stream_chunks_per_s" in entry:
            print(f"[{phase}] stream chunks/s while loading: {entry['stream_chunks_per_s']:.0f}")
        if "add_lora" in entry:
            print(f"[{phase}] py-spy samples in add_lora, by part: {json.dumps(entry['add_lora'])}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
