"""Many policies on one serving fleet (issue #43): 1, 2, 4 and 8 policies on one vLLM engine, the same total load.

For each P in ``--policies`` (default 1,2,4,8) one ``streamrl up --policies ...`` stack serves and trains P
policies against one engine: the embedded broker, one gateway serving every policy, and one real trainer per
policy (``streamrl trainer``, its own process, consumer group and adapters), each publishing a LoRA version
after every step that the gateway hot-swaps in. The engine is started here once (LoRA slots sized by
``lora_slots(max P, max_loaded_versions)``, the same engine for every P) unless ``--upstream`` names one.
The load is the same for every P: ``--clients`` closed-loop clients spread evenly over the P policies, each
keeping ``--group-size`` chat calls to its policy in flight (the members of its groups, one after another;
``ignore_eos``, so every reply is ``--max-tokens`` long whatever the policies learn), a reward posted for each;
so ``clients x group_size`` calls are in flight and every trainer trains on its own policy's trajectories.

Each P is measured from the moment every policy serves a trained version (warm-up) for ``--seconds``:

* rollout (completion) tokens/s per policy and in total, and total(P) / total(1);
* publish -> served per version: from the policy record's publication to the first request served by that
  version (clients' view: includes waiting for that policy's next request), and publish -> routed (the
  gateway's own log line), p50 / p99 over every version of every policy published in the window; to tell the
  two apart, the longest wait between two requests of one policy (the load's own gaps) and the requests sent
  after a swap was routed that an older version still served (the gateway's);
* failed requests (any status but 200), request latency p50 / p99;
* each trainer's step time (``step_s``, the optimizer step, from its history) and its whole cycle per
  version (step + adapter + checkpoint + announce), p50, beside the others;
* the seconds in which a version's requests waited in the engine for a GPU LoRA slot (vLLM's own
  ``lora_requests_info``, polled twice a second: an adapter waiting while ``max_lora`` others run), which the
  clients' publish -> served includes and the gateway's log cannot see;
* GPU memory (``nvidia-smi``, sampled during the window: the whole GPU, and per process the engine's and
  each trainer's where the process ids can be told apart); ``n/a`` without nvidia-smi.

    .venv/bin/python bench/policies_bench.py --policies 1,2 --seconds 8 --clients 2 --group-size 2 \\
        --groups-per-step 1 --max-tokens 8 --json runs/policies-cpu.json                 # CPU smoke run, tiny model
    python3 bench/policies_bench.py --model smollm2-135m --model-cache STASH --policies 1,8,2,4 \\
        --engine-device 0 --trainer-device cuda:0 --json OUT/policies.json               # one GPU (benches.sh policies)

Serving alone (``--imitate-training RATE``): no trainers (``streamrl up --no-train``); the bench publishes a copy of
one LoRA adapter (random, rank ``--lora-rank``, made once on the CPU) as each policy's next version, RATE versions
a second over all policies in turn (each P the same swap rate), so the engine serves and swaps as many adapters as
with trainers but shares the GPU with none: what P costs the engine itself, apart from the trainers' contention.

    python3 bench/policies_bench.py --model smollm2-135m --model-cache STASH --policies 1,8,2,4 \
        --engine-device 0 --imitate-training 1.0 --json OUT/policies-serving.json        # benches.sh policies-serving

P values run in the order given (the JSON is rewritten after each); ``--budget-s`` skips a P that would not end
inside it (a device's limit per command). Logs of every part stay in ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
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

import aiohttp
import httpx
import numpy as np
from gateway_bench import children
from harness import stamp
from learn_bench import engine_timeline, read_history, scrape, unload_adapters, warm_engine

from streamrl.config_file import nest
from streamrl.trainer.config import TrainerConfig

PROMPTS = ["Tell me about the sea.", "Write a short story about a lighthouse.", "Explain how rain forms.",
           "Describe a walk through a forest.", "What makes a good friend?", "Tell me about the moon."]
SERVED_LINE = re.compile(r"now served by (\S+)@v(\d+) \(was [^)]*\), (\d+) ms after publication")


@dataclass
class Sample:
    policy: str
    start: float
    end: float
    status: int
    version: int
    tokens: int


# ------------------------------------------------------------------------------------------------ load


async def call(session: aiohttp.ClientSession, gw: str, policy: str, gid: str, j: int, prompt: str, reward: float,
               samples: list[Sample], args: argparse.Namespace) -> None:
    """One chat call of a group, then its reward."""
    tid = f"{gid}-{j}"
    body = {"model": policy, "messages": [{"role": "user", "content": prompt}], "max_tokens": args.max_tokens,
            "temperature": 1.0, "ignore_eos": True}
    start = time.time()
    status, version, tokens = 0, -1, 0
    try:
        async with session.post(f"{gw}/v1/chat/completions", json=body,
                                headers={"X-Trajectory-Id": tid, "X-Group-Id": gid}) as r:
            raw = await r.read()
            status, version = r.status, int(r.headers.get("x-policy-version", -1))
            if status == 200:
                tokens = int(json.loads(raw)["usage"]["completion_tokens"])
    except (TimeoutError, aiohttp.ClientError, ValueError, KeyError):
        pass
    samples.append(Sample(policy, start, time.time(), status, version, tokens))
    if status == 200:
        with contextlib.suppress(TimeoutError, aiohttp.ClientError):
            async with session.post(f"{gw}/v1/rewards", json={"trajectory_id": tid, "group_id": gid,
                                                              "group_size": args.group_size, "reward": reward}) as r:
                await r.read()


async def client(session: aiohttp.ClientSession, gw: str, policy: str, index: int, stop: asyncio.Event,
                 samples: list[Sample], args: argparse.Namespace) -> None:
    """``group_size`` calls in flight to ``policy``, each lane taking the next member of the next group when its
    call ends, each call rewarded (random rewards: every group has signal and the trainers train; what they learn
    is not what is measured). Every reply has the same length, so the lanes keep the random offsets they start
    with: calls arrive spread out, not a group at a time, and a new version's first request is not held back by
    the load's own bursts."""
    rng = random.Random(index)
    slots = itertools.count()

    async def lane() -> None:
        await asyncio.sleep(rng.uniform(0.0, args.stagger_s))
        while not stop.is_set():
            group, member = divmod(next(slots), args.group_size)
            prompt = PROMPTS[(index + group) % len(PROMPTS)]  # one prompt per group, as GRPO samples a group
            await call(session, gw, policy, f"{policy}-c{index}-g{group}", member, prompt, rng.random(), samples,
                       args)

    await asyncio.gather(*(lane() for _ in range(args.group_size)))


def routed_versions(gw: str) -> dict[str, int]:
    return {name: p["version"] for name, p in httpx.get(f"{gw}/health", timeout=5).json()["policies"].items()}


class Load:
    """The clients in a thread of their own (an event loop), started and stopped from the bench's thread."""

    def __init__(self, gw: str, names: list[str], args: argparse.Namespace) -> None:
        self.gw, self.names, self.args = gw, names, args
        self.samples: list[Sample] = []
        self.loop = asyncio.new_event_loop()
        self.stop_event: asyncio.Event | None = None
        self.thread = threading.Thread(target=self._run, name="load", daemon=True)
        self.ready = threading.Event()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._main())

    async def _main(self) -> None:
        self.stop_event = asyncio.Event()
        self.ready.set()
        timeout = aiohttp.ClientTimeout(total=self.args.request_timeout_s)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
            await asyncio.gather(*(client(session, self.gw, self.names[i % len(self.names)], i, self.stop_event,
                                          self.samples, self.args) for i in range(self.args.clients)))

    def start(self) -> Load:
        self.thread.start()
        self.ready.wait()
        return self

    def stop(self) -> None:
        assert self.stop_event is not None
        self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(self.args.request_timeout_s + 30)


# ------------------------------------------------------------------------------------------------ readings


def policy_records(bootstrap: str, prefix: str) -> list[Any]:
    """Every policy record on the stack's policy topic (name, version, created: its publication time)."""
    from kafka import TopicPartition

    from streamrl.broker.clients import make_consumer
    from streamrl.broker.schema import PolicyRecord, RecordError, decode
    from streamrl.broker.topics import Topics

    topic = Topics(prefix).policy
    consumer = make_consumer(bootstrap, group_id=None, client_id="policies-bench")
    out = []
    try:
        tps = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or {0}]
        consumer.assign(tps)
        consumer.seek_to_beginning(*tps)
        end = consumer.end_offsets(tps)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # to the end offsets, then until a poll comes back empty
            polled = consumer.poll(timeout_ms=300)
            for records in polled.values():
                for r in records:
                    with contextlib.suppress(RecordError):
                        rec = decode(r.value)
                        if isinstance(rec, PolicyRecord):
                            out.append(rec)
            if not polled and all(consumer.position(tp) >= end[tp] for tp in tps):
                break
    finally:
        consumer.close()
    return out


class GpuMemory(threading.Thread):
    """``nvidia-smi`` every ``interval`` seconds: the GPU's used memory, and each compute process's (by pid)."""

    def __init__(self, interval: float = 2.0) -> None:
        super().__init__(daemon=True)
        self.interval = interval
        self.total: list[float] = []
        self.per_pid: dict[int, float] = {}
        self.halt = threading.Event()
        self.present = shutil.which("nvidia-smi") is not None

    def run(self) -> None:
        while self.present and not self.halt.is_set():
            with contextlib.suppress(OSError, ValueError, subprocess.SubprocessError):
                used = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                      capture_output=True, text=True, timeout=10).stdout.split()
                self.total.append(sum(float(x) for x in used))
                apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                       "--format=csv,noheader,nounits"], capture_output=True, text=True,
                                      timeout=10).stdout
                for line in apps.splitlines():
                    pid, mib = (x.strip() for x in line.split(","))
                    self.per_pid[int(pid)] = max(self.per_pid.get(int(pid), 0.0), float(mib))
            self.halt.wait(self.interval)

    def summary(self, roles: dict[int, str]) -> dict[str, Any]:
        if not self.present:
            return {"gpu_memory": "n/a (no nvidia-smi)"}
        by_role: dict[str, float] = {}
        for pid, mib in self.per_pid.items():
            role = roles.get(pid, "other")
            by_role[role] = by_role.get(role, 0.0) + mib
        trainers = [v for k, v in by_role.items() if k.startswith("trainer")]
        return {"gpu_used_mib_max": max(self.total, default=None), "gpu_used_mib_mean":
                float(np.mean(self.total)) if self.total else None, "by_process_mib": by_role,
                "engine_mib": by_role.get("engine"), "trainers_mib": sum(trainers) if trainers else None}


class EngineSlotWaits(threading.Thread):
    """The engine's ``/metrics`` every ``interval`` seconds, read as ``learn_bench.engine_timeline`` reads them: the
    seconds in which a version's requests waited there for a GPU LoRA slot (``engine/lora_slots.py`` sizes the slots
    so that none do), and which versions: a wait in the clients' publish -> served that the gateway's log cannot
    see."""

    def __init__(self, url: str, interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.url, self.interval = url, interval
        self.halt = threading.Event()
        self.samples: list[tuple[float, dict[str, float]]] = []

    def run(self) -> None:
        with httpx.Client() as client:
            while not self.halt.is_set():
                self.samples.append((time.time(), scrape(client, f"{self.url}/metrics")))
                self.halt.wait(self.interval)

    def summary(self) -> dict[str, Any]:
        timeline = engine_timeline(self.samples, self.samples[0][0] if self.samples else 0.0)
        return {"engine_lora_slot_wait_s": timeline["lora_slot_wait_s"],
                "engine_lora_slot_waited": timeline["lora_slot_waited"],
                "engine_metric_samples": sum(1 for _, sample in self.samples if sample)}


def gpu_used_mib() -> float | None:
    """The GPU's used memory now (every GPU summed), None without nvidia-smi."""
    with contextlib.suppress(OSError, ValueError, subprocess.SubprocessError):
        used = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=10).stdout.split()
        return sum(float(x) for x in used) if used else None
    return None


def descendants(pid: int) -> set[int]:
    out, todo = {pid}, [pid]
    while todo:
        for c in children(todo.pop()):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def process_roles(engine_pid: int | None, up_pid: int) -> dict[int, str]:
    """pid -> engine / trainer-NAME for the processes that may hold GPU memory (the trainer's config file names
    its policy on its command line)."""
    roles = {p: "engine" for p in descendants(engine_pid)} if engine_pid else {}
    for pid in descendants(up_pid):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"trainer" in argv and b"--config" in argv:
                config = json.loads(Path(argv[argv.index(b"--config") + 1].decode()).read_text())
                for p in descendants(pid):
                    roles[p] = f"trainer-{config['name']}"
    return roles


def pct(xs: list[float] | np.ndarray, q: float, digits: int = 1) -> float | None:
    a = np.asarray(xs, dtype=float)
    return round(float(np.percentile(a, q)), digits) if a.size else None


# ------------------------------------------------------------------------------------------------ one P


class Publisher(threading.Thread):
    """Training imitated: ``rate`` versions a second over the policies in turn, each a copy of ``adapter`` under the
    run's ``adapters/NAME/vN`` (the gateway's adapter root) published as NAME's next version. The first round (v1 of
    every policy) goes out at once, so the warm-up does not wait for it."""

    def __init__(self, bootstrap: str, prefix: str, names: list[str], adapter: Path, base_model: str,
                 run_dir: Path, rate: float) -> None:
        super().__init__(name="publisher", daemon=True)
        self.bootstrap, self.prefix, self.names, self.adapter = bootstrap, prefix, names, adapter
        self.base_model, self.run_dir, self.rate = base_model, run_dir, rate
        self.halt = threading.Event()
        self.published = 0

    def run(self) -> None:
        from streamrl.broker.policy_log import PolicyLog, adapter_record
        from streamrl.broker.topics import Topics

        log = PolicyLog(self.bootstrap, Topics(self.prefix), client_id="policies-bench", publisher="policies-bench")
        versions = dict.fromkeys(self.names, 0)
        try:
            for i, name in enumerate(itertools.cycle(self.names)):
                if i >= len(self.names) and self.halt.wait(1.0 / self.rate):
                    return
                versions[name] += 1
                target = self.run_dir / "adapters" / name / f"v{versions[name]}"
                shutil.copytree(self.adapter, target)
                log.publish(adapter_record(name, versions[name], target, self.base_model))
                self.published += 1
        finally:
            log.close()


def make_adapter(model: str, out: Path, rank: int) -> Path:
    """A LoRA adapter of ``model`` as the trainer writes one (its target modules, rank ``rank``), its B matrices
    random so that serving it is not serving the base model; made once, on the CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    from streamrl.trainer.model import attach_lora
    from streamrl.trainer.publish import write_adapter_files

    target = out / f"adapter-r{rank}"
    if (target / "adapter_config.json").exists():
        return target
    torch.manual_seed(0)
    peft_model = attach_lora(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
                             TrainerConfig.load(None, model=model, lora_rank=rank))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 1e-3)
    write_adapter_files(peft_model, target, {"imitated": True})
    return target


def up_config(p: int, names: list[str], model: str, upstream: str, run_dir: Path, port: int, broker_port: int,
              args: argparse.Namespace) -> dict[str, Any]:
    return {
        "up": {"model": model, "port": port, "work_dir": str(run_dir), "upstreams": [upstream],
               "broker_port": broker_port, "policy_name": names[0], "policies": names[1:],
               "train": not args.imitate_training,
               "trainer_device": args.trainer_device, "kafka": {"topic_prefix": f"pb{p}"}},
        "gateway": {"max_loaded_versions": args.max_loaded_versions},
        "trainer": nest(TrainerConfig, {"learning_rate": args.learning_rate, "group_size": args.group_size,
                                        "groups_per_step": args.groups_per_step, "lora_rank": args.lora_rank,
                                        "max_lag": 4, "micro_batch_tokens": args.micro_batch_tokens,
                                        "max_step_tokens": 0, "group_timeout_s": 30.0, "seed": 0}),
    }


def trainer_files(run_dir: Path, names: list[str]) -> dict[str, tuple[Path, Path]]:
    """Each policy's trainer config file and history (``up``'s layout: one policy alone has the plain names)."""
    if len(names) == 1:
        return {names[0]: (run_dir / "trainer.json", run_dir / "history.jsonl")}
    return {n: (run_dir / f"trainer-{n}.json", run_dir / f"history.{n}.jsonl") for n in names}


def stop_up(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)  # up stops every part within 15 s
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def run_p(p: int, model: str, upstream: str, engine_pid: int | None, out: Path, args: argparse.Namespace,
          adapter: Path | None = None) -> dict[str, Any]:
    from streamrl.broker.embedded import free_port
    from streamrl.child import wait_http

    names = [f"p{p}-{chr(ord('a') + i)}" if i < 26 else f"p{p}-{i}" for i in range(p)]
    run_dir = out / f"p{p}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    port, broker_port = free_port(), free_port()
    cfg = run_dir / "up-config.json"
    cfg.write_text(json.dumps(up_config(p, names, model, upstream, run_dir, port, broker_port, args), indent=2))
    gw = f"http://127.0.0.1:{port}"
    before = gpu_used_mib()  # the engine alone (and whatever else runs on the GPU)
    t_start = time.monotonic()
    with open(run_dir / "up.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "streamrl.cli", "up", "--config", str(cfg)],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    load = publisher = None
    gpu, slots = GpuMemory(), EngineSlotWaits(upstream)
    result: dict[str, Any] = {"policies": p, "names": names}
    try:
        wait_http(gw, 300, proc, what="gateway")
        if adapter is not None:  # training imitated: no trainer to wait for
            publisher = Publisher(f"127.0.0.1:{broker_port}", f"pb{p}", names, adapter, model, run_dir,
                                  args.imitate_training)
            publisher.start()
        files = trainer_files(run_dir, names) if adapter is None else {}
        for name, (config_file, _) in files.items():  # every trainer has loaded its model and serves /metrics
            deadline = time.monotonic() + 600
            while not config_file.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"no trainer config for {name} (see {run_dir / 'up.log'})")
                time.sleep(0.2)
            metrics_port = json.loads(config_file.read_text())["metrics_port"]
            wait_http(f"http://127.0.0.1:{metrics_port}", 600, proc, what=f"trainer {name}", path="/metrics")
        result["start_s"] = round(time.monotonic() - t_start, 1)
        load = Load(gw, names, args).start()
        deadline = time.monotonic() + args.warmup_timeout_s
        while min(routed_versions(gw).values()) < 1:  # every policy serves a trained version
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"not every policy served a trained version: {routed_versions(gw)} "
                                   f"(see {run_dir / 'up.log'})")
            time.sleep(0.2)
        time.sleep(args.warmup_s)
        result["warmup_s"] = round(time.monotonic() - t_start - result["start_s"], 1)
        gpu.start()
        slots.start()
        t0 = time.time()
        time.sleep(args.seconds)
        t1 = time.time()
        slots.halt.set()
        records = policy_records(f"127.0.0.1:{broker_port}", f"pb{p}")
        roles = process_roles(engine_pid, proc.pid)
        gpu.halt.set()
        if publisher is not None:
            publisher.halt.set()
            publisher.join(30)
            result["imitated_versions_published"] = publisher.published
        load.stop()
        samples, load = load.samples, None
        gpu.join(15)
        slots.join(15)
        result.update(gpu.summary(roles), **slots.summary())
        if before is not None and result.get("gpu_used_mib_max") is not None:
            result["gpu_used_mib_before"] = before
            result["gpu_mib_added_by_stack"] = result["gpu_used_mib_max"] - before  # trainers, adapters
        result["up_exit"] = proc.poll()  # None: every part was still running at the window's end
    finally:
        if publisher is not None:
            publisher.halt.set()
        if load is not None:
            load.stop()
        gpu.halt.set()
        slots.halt.set()
        stop_up(proc)
        for name in names:  # the next P starts from the same engine state, no adapter outliving its files
            with contextlib.suppress(httpx.HTTPError):
                unload_adapters(upstream, f"{name}@")
    result["wall_s"] = round(time.monotonic() - t_start, 1)
    gateway_log = (run_dir / "logs" / "gateway.log").read_text(errors="replace")
    result.update(summarise(names, samples, records, gateway_log, t0, t1))
    if adapter is None:
        result.update(trainer_steps(names, run_dir, t0, t1))
    return result


def summarise(names: list[str], samples: list[Sample], records: list[Any], gateway_log: str, t0: float,
              t1: float) -> dict[str, Any]:
    """Throughput, failures, latency and publish -> served of the window [t0, t1]."""
    span = t1 - t0
    done = [s for s in samples if t0 <= s.end <= t1]
    ok = [s for s in done if s.status == 200]
    per_policy = {n: sum(s.tokens for s in ok if s.policy == n) / span for n in names}
    routed_ms = {(m.group(1), int(m.group(2))): int(m.group(3)) for m in SERVED_LINE.finditer(gateway_log)}
    served_ms, routed_in_window, unserved, older_after_routing = [], [], 0, []
    per_policy_served: dict[str, list[float]] = {n: [] for n in names}
    starts_of = {n: sorted(s.start for s in samples if s.policy == n) for n in names}
    for rec in records:
        if rec.name not in per_policy or not t0 <= rec.created <= t1:
            continue
        routed_at = None
        if (rec.name, rec.version) in routed_ms:
            routed_in_window.append(routed_ms[(rec.name, rec.version)])
            routed_at = rec.created + routed_ms[(rec.name, rec.version)] / 1000
        starts = [s.start for s in samples if s.policy == rec.name and s.version == rec.version and s.status == 200]
        if starts:
            ms = (min(starts) - rec.created) * 1000
            served_ms.append(ms)
            per_policy_served[rec.name].append(ms)
            if routed_at is not None:  # requests sent after the gateway logged the swap that an older version served
                older_after_routing.append(sum(1 for s in samples if s.policy == rec.name and s.status == 200
                                               and routed_at < s.start < min(starts) and s.version < rec.version))
        else:
            unserved += 1  # superseded before any request of its policy came (or the run ended first)
    # the client's own arrival pattern: the longest wait between two requests of one policy sent in the window
    gaps = [(b - a) * 1000 for n in names for a, b in itertools.pairwise([t for t in starts_of[n] if t0 <= t <= t1])]
    latency = [(s.end - s.start) * 1000 for s in ok]
    total = sum(per_policy.values())
    return {
        "t0": t0, "t1": t1, "seconds": round(span, 2), "requests": len(done), "requests_ok": len(ok),
        "failed_requests": sum(s.status != 200 for s in done),
        "failed_requests_whole_run": sum(s.status != 200 for s in samples),
        "requests_whole_run": len(samples),
        "rollout_tokens_per_s_total": round(total, 1),
        "rollout_tokens_per_s_per_policy": {n: round(v, 1) for n, v in per_policy.items()},
        "rollout_tokens_per_s_per_policy_mean": round(total / len(names), 1),
        "latency_p50_ms": pct(latency, 50), "latency_p99_ms": pct(latency, 99),
        "versions_published": len(served_ms) + unserved, "versions_unserved": unserved,
        "publish_to_served_p50_ms": pct(served_ms, 50), "publish_to_served_p99_ms": pct(served_ms, 99),
        "publish_to_served_max_ms": pct(served_ms, 100),
        "publish_to_served_p99_ms_per_policy": {n: pct(v, 99) for n, v in per_policy_served.items()},
        "publish_to_routed_p50_ms": pct(routed_in_window, 50), "publish_to_routed_p99_ms": pct(routed_in_window, 99),
        "older_version_after_routing": {"requests": sum(older_after_routing),
                                        "versions": sum(1 for x in older_after_routing if x)},
        "request_gap_p99_ms": pct(gaps, 99), "request_gap_max_ms": pct(gaps, 100),
        "versions_per_s_per_policy": round((len(served_ms) + unserved) / span / len(names), 3),
    }


def trainer_steps(names: list[str], run_dir: Path, t0: float | None, t1: float | None) -> dict[str, Any]:
    """Each trainer's steps in the window (by their history line's time; all but the first when no window):
    step_s (the optimizer step) and the whole cycle of a version, p50."""
    out: dict[str, Any] = {}
    for name, (_, history_file) in trainer_files(run_dir, names).items():
        history = read_history(history_file)
        steps = [h for h in history if t0 <= h["time"] <= t1] if t0 is not None and t1 is not None else history[1:]
        cycle = [sum(h.get(k, 0.0) for k in ("step_s", "adapter_s", "checkpoint_s", "announce_s")) for h in steps]
        out[name] = {"steps": len(steps), "steps_total": len(history),
                     "step_s_p50": pct([h["step_s"] for h in steps if "step_s" in h], 50, 3),
                     "step_s_mean": round(float(np.mean([h["step_s"] for h in steps if "step_s" in h])), 3)
                     if steps else None,
                     "cycle_s_p50": pct(cycle, 50, 3), "wait_s_p50": pct([h.get("wait_s", 0.0) for h in steps], 50, 3),
                     "tokens_per_step_p50": pct([h.get("tokens", 0) for h in steps], 50)}
    return {"trainers": out}


# ------------------------------------------------------------------------------------------------ report


def add_ratios(runs: list[dict[str, Any]]) -> None:
    """total(P) / total(1), where P = 1 ran."""
    one = next((r for r in runs if r.get("policies") == 1 and r.get("rollout_tokens_per_s_total")), None)
    for r in runs:
        if one is not None and r.get("rollout_tokens_per_s_total") is not None:
            r["total_vs_one_policy"] = round(r["rollout_tokens_per_s_total"] / one["rollout_tokens_per_s_total"], 3)


def _f(x: Any, digits: int = 0) -> str:
    return "-" if x is None else f"{x:,.{digits}f}" if isinstance(x, int | float) else str(x)


def print_table(runs: list[dict[str, Any]]) -> None:
    print("\n| policies | rollout tok/s total | vs 1 policy | per policy mean (min-max) | publish->served p50 / p99 ms "
          "| publish->routed p50 / p99 ms | versions (unserved) | failed / requests | latency p50 / p99 ms "
          "| older version after routing (requests / versions) | request gap p99 ms "
          "| trainer step_s p50, each | version cycle s p50, each | GPU MiB used (engine / trainers) "
          "| waited for a LoRA slot in the engine s (versions) |")
    print("| ---: | ---: | ---: | --- | --- | --- | ---: | ---: | --- | --- | ---: | --- | --- | --- | --- |")
    for r in sorted(runs, key=lambda r: r["policies"]):
        if "error" in r:
            print(f"| {r['policies']} | failed: {r['error']} |" + " |" * 13)
            continue
        per = list(r["rollout_tokens_per_s_per_policy"].values())
        trainers = r.get("trainers", {})
        older = r.get("older_version_after_routing", {})
        gpu = (f"{_f(r.get('gpu_used_mib_max'))} ({_f(r.get('engine_mib'))} / "
               f"{_f(r.get('trainers_mib') or r.get('gpu_mib_added_by_stack'))})"
               if "gpu_used_mib_max" in r else r.get("gpu_memory", "n/a"))
        print(f"| {r['policies']} | {_f(r['rollout_tokens_per_s_total'])} | {_f(r.get('total_vs_one_policy'), 2)} "
              f"| {_f(r['rollout_tokens_per_s_per_policy_mean'])} ({_f(min(per))}-{_f(max(per))}) "
              f"| {_f(r['publish_to_served_p50_ms'])} / {_f(r['publish_to_served_p99_ms'])} "
              f"| {_f(r['publish_to_routed_p50_ms'])} / {_f(r['publish_to_routed_p99_ms'])} "
              f"| {r['versions_published']} ({r['versions_unserved']}) | {r['failed_requests']} / {r['requests']} "
              f"| {_f(r['latency_p50_ms'])} / {_f(r['latency_p99_ms'])} "
              f"| {older.get('requests', '')} / {older.get('versions', '')} | {_f(r.get('request_gap_p99_ms'))} "
              f"| {', '.join(_f(t['step_s_p50'], 2) for t in trainers.values())} "
              f"| {', '.join(_f(t['cycle_s_p50'], 2) for t in trainers.values())} | {gpu} "
              f"| {_f(r.get('engine_lora_slot_wait_s'), 1)} ({len(r.get('engine_lora_slot_waited', []))}) |")


def parse_policies(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--policies must be comma-separated counts, not {text!r}") from None
    if not values or min(values) < 1 or len(set(values)) != len(values):
        raise ValueError(f"--policies must name positive counts, each once: {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default="1,2,4,8", help="comma-separated policy counts, run in this order")
    p.add_argument("--clients", type=int, default=8,
                   help="clients in all, spread over the policies, each --group-size calls in flight")
    p.add_argument("--stagger-s", type=float, default=2.0, help="each call lane starts after a random wait up to this")
    p.add_argument("--seconds", type=float, default=30.0, help="the measured window per policy count")
    p.add_argument("--warmup-s", type=float, default=3.0, help="after every policy serves a trained version")
    p.add_argument("--warmup-timeout-s", type=float, default=300.0)
    p.add_argument("--max-tokens", type=int, default=64, help="every reply's length (ignore_eos)")
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--groups-per-step", type=int, default=2)
    p.add_argument("--learning-rate", type=float, default=2e-4)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--micro-batch-tokens", type=int, default=4096)
    p.add_argument("--max-loaded-versions", type=int, default=3, help="the gateway's, per policy")
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--model", help="a checkpoint or a packaged model (smollm2-135m); default: the tiny model")
    p.add_argument("--model-cache", default="runs/model-cache", help="where a packaged model is converted")
    p.add_argument("--upstream", help="a running `streamrl engine` (serving --model, LoRA slots for the largest P)")
    p.add_argument("--engine-device", help="CUDA device of the engine started here (e.g. 0)")
    p.add_argument("--gpu-memory-utilization", type=float, help="vLLM's memory fraction (the trainers share the GPU)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--engine-args", default="", help="extra vLLM flags of the engine started here")
    p.add_argument("--trainer-device", default="auto", help="every trainer's device (cpu, cuda:0, ...)")
    p.add_argument("--budget-s", type=float, default=0.0,
                   help="seconds from the start within which every P must end: one that would not is skipped (0: none)")
    p.add_argument("--out", default="runs/policies-bench", help="each P's run directory (logs, histories)")
    p.add_argument("--json", help="the result file (default OUT/policies_bench.json), rewritten after every P")
    p.add_argument("--imitate-training", type=float, default=0.0, metavar="RATE",
                   help="no trainers: the bench publishes RATE adapter versions a second over all policies in turn "
                        "(serving and swapping alone; default 0: a real trainer per policy)")
    args = p.parse_args(argv)
    try:
        counts = parse_policies(args.policies)
    except ValueError as exc:
        print(f"policies_bench: {exc}", file=sys.stderr)
        return 2
    began = time.monotonic()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    json_path = Path(args.json) if args.json else out / "policies_bench.json"

    from streamrl.engine.lora_slots import lora_slots
    from streamrl.engine.server import Engine, EngineConfig
    from streamrl.packaged_models import resolve
    from streamrl.tiny_model import build_model

    if args.model:
        model = resolve(args.model, Path(args.model_cache).resolve(), lambda s: print(s, flush=True))
    else:
        model = str(out / "model")
        if not (out / "model" / "config.json").exists():
            build_model(out / "model", "tiny", seed=0)
    max_loras, max_cpu_loras = lora_slots(max(counts), args.max_loaded_versions)
    result: dict[str, Any] = {
        "bench": "policies_bench", "command": sys.argv if argv is None else argv, "model": model,
        **stamp(),
        "args": {k: v for k, v in vars(args).items() if k not in ("json", "out")},
        "engine": {"max_loras": max_loras, "max_cpu_loras": max_cpu_loras} if not args.upstream else
        {"upstream": args.upstream}, "runs": [], "skipped": []}
    engine = None
    try:
        if args.upstream:
            upstream = args.upstream.rstrip("/")
        else:
            print(f"starting vLLM on {model} (max_loras {max_loras}, max_cpu_loras {max_cpu_loras}) ...", flush=True)
            t = time.monotonic()
            engine = Engine(EngineConfig(
                model=model, max_loras=max_loras, max_cpu_loras=max_cpu_loras,
                max_lora_rank=max(16, args.lora_rank), max_model_len=args.max_model_len, device=args.engine_device,
                gpu_memory_utilization=args.gpu_memory_utilization,
                extra_args=args.engine_args.split()), log_file=out / "engine.log").start(timeout=900)
            upstream = engine.url
            result["engine"]["start_s"] = round(time.monotonic() - t, 1)
        result["engine"]["warmup_s"] = round(warm_engine(upstream, args.clients * args.group_size, args.max_tokens), 1)
        adapter = make_adapter(model, out, args.lora_rank) if args.imitate_training else None
        overhead = 90.0  # a P's start-up, warm-up and stop beyond its window: a guess, then the longest seen + 10 s
        for count in counts:  # (more trainers start more slowly: 4 s more per policy)
            if args.budget_s and time.monotonic() - began + args.seconds + overhead + 4 * count > args.budget_s:
                print(f"P={count}: skipped, it would not end within --budget-s", flush=True)
                result["skipped"].append(count)
                continue
            print(f"P={count}: {args.clients} clients over {count} policies, {args.seconds:.0f} s ...", flush=True)
            try:
                r = run_p(count, model, upstream, engine.proc.pid if engine and engine.proc else None, out, args,
                          adapter)
            except Exception as exc:  # the other counts still run; the failure is in the result
                r = {"policies": count, "error": f"{type(exc).__name__}: {exc}"}
            result["runs"].append(r)
            if "wall_s" in r:
                overhead = max(overhead if len(result["runs"]) > 1 else 0.0, r["wall_s"] - args.seconds + 10.0)
            add_ratios(result["runs"])
            print(json.dumps({k: v for k, v in r.items() if k not in ("t0", "t1")}), flush=True)
            json_path.write_text(json.dumps(result, indent=1))
    finally:
        if engine is not None:
            engine.stop()
    add_ratios(result["runs"])
    json_path.write_text(json.dumps(result, indent=1))
    print_table(result["runs"])
    if result["skipped"]:
        print(f"\nskipped (time budget): P = {', '.join(map(str, result['skipped']))}")
    print(f"\n{json_path}")
    return 0 if result["runs"] and all("error" not in r for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
