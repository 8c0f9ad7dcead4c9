"""`streamrl up`: broker, vLLM engine, gateway and trainer as one process tree, with one combined log.

Every part runs as its own child process in its own process group, so a shutdown (Ctrl-C, SIGTERM, a
part that dies, or the demo finishing) stops each group in order, children included: demo -> judge -> gateway
-> trainer -> engine -> broker. ``--bootstrap-servers`` uses an external Kafka instead of the embedded
broker and ``--upstream`` external vLLM servers instead of starting one; nothing else changes.

Configuration: defaults, then one TOML/JSON file (tables ``[up]``, ``[engine]``, ``[gateway]``,
``[trainer]``, ``[demo]``), then flags. The ``[gateway]`` and ``[trainer]`` tables hold ``GatewayConfig``
and ``TrainerConfig`` fields; ``up`` adds what it owns, writes the effective configurations to
``<work-dir>/gateway.json`` and ``<work-dir>/trainer.json`` and starts each part with ``--config``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from streamrl.broker.embedded import EmbeddedBroker, free_port
from streamrl.broker.security import KafkaSecurity
from streamrl.broker.topics import Topics, create_topics
from streamrl.child import spawn, stop_group, wait_http
from streamrl.config_file import check_fields, read_file
from streamrl.config_flags import add_config_flags, given
from streamrl.engine import Engine, EngineConfig
from streamrl.gateway.auth import check_bind, load_keys
from streamrl.gateway.config import GatewayConfig
from streamrl.packaged_models import MODELS, resolve
from streamrl.producers.demo_cli import DemoConfig, run_demo
from streamrl.producers.demo_model import build_demo_model, default_cache_dir
from streamrl.trainer.config import TrainerConfig


@dataclass(frozen=True)
class DemoTrainer:
    """Trainer settings under which the demo model learns the demo task within minutes on 2 CPU cores
    (measured: docs/loop.md). Applied with ``--demo`` below whatever the ``[trainer]`` table says."""

    learning_rate: float = 2e-2
    groups_per_step: int = 2
    group_size: int = 8
    lora_rank: int = 8
    max_lag: int = 4
    group_timeout_s: float = 20.0
    max_step_tokens: int = 0
    """Fixed steps: the demo's producer is paced to ``groups_per_step`` groups per version (its pacer
    counts on it), so there is never a surplus for a bigger step to take."""


ENGINE_OWNED = ("model", "host", "token_capture")
"""``EngineConfig`` fields ``up`` sets itself (``token_capture`` from ``[up]``, one switch for the engine and
the gateway); an ``[engine]`` table may set every other one."""


@dataclass
class UpConfig:
    model: str | None = None
    """Base model path or id. None builds the demo model into the cache directory."""
    host: str = "127.0.0.1"
    port: int = 8080
    """Gateway port (0 = a free one)."""
    work_dir: str | None = None
    """Adapters, logs, trainer config and history. None = a new directory per run under the cache (the
    embedded broker keeps nothing across runs, so neither should the trainer's offsets)."""
    bootstrap_servers: str | None = None
    """External Kafka; None starts the embedded broker."""
    kafka: KafkaSecurity = field(default_factory=KafkaSecurity)
    """Security settings of the external Kafka (SASL, TLS), for every client of every part."""
    broker_port: int | None = None
    partitions: int = 4
    upstreams: list[str] = field(default_factory=list)
    """External vLLM base URLs; empty starts one engine."""
    topic_prefix: str = "streamrl"
    policy_name: str = "policy"
    token_capture: bool = True
    """The engine ``up`` starts offers capture frames and the gateway takes tokens from them; off, the
    engine is a plain vLLM server and the gateway reads tokens from its JSON."""
    gateways: int = 1
    """Gateway processes on the gateway's port (``streamrl gateway --workers N``: ``SO_REUSEPORT``, each its
    own gateway id, producer and spool, coordinated through the gateways topic); overrides the [gateway]
    table's ``workers`` when above 1."""
    trainer_device: str | None = None
    """Trainer device: auto, cpu, cuda, cuda:N (the [trainer] table's ``device``)."""
    trainer_nproc: int = 1
    """Trainer processes (torchrun, one per GPU) for multi-GPU data-parallel training."""
    trainer_gpus: list[str] = field(default_factory=list)
    """GPUs of the trainer's ranks, one per rank (their ``CUDA_VISIBLE_DEVICES``; rank r takes the r-th):
    e.g. ["2", "3"] with trainer_nproc = 2. Empty: as the [trainer] table's ``device`` says."""
    replicas: int = 1
    """vLLM replicas to start (each its own server; the gateway spreads requests over them and loads every
    policy version into each before routing to it). Ignored with ``upstreams``."""
    replica_gpus: list[str] = field(default_factory=list)
    """GPU of each replica, one per replica (e.g. ["0", "1"] with replicas = 2; its ``CUDA_VISIBLE_DEVICES``).
    Empty: the [engine] table's ``device`` for all of them."""
    verbose: bool = False
    """Show the engine's INFO lines in the combined log too (they are always in its log file)."""
    judge: bool = False
    """Start ``streamrl judge`` beside the trainer, judging through the gateway with the base model (its calls
    recorded as purpose ``judge``, never trained on); on by itself with ``--demo-reward judge``."""
    engine_table: dict[str, Any] = field(default_factory=dict)
    """The config file's [engine] table and ``--engine-*`` flags: ``EngineConfig`` fields but model and host
    (device, gpu_memory_utilization, max_model_len, extra_args, ...), checked on load."""
    demo: DemoConfig | None = None
    trainer_table: dict[str, Any] = field(default_factory=dict)
    """The config file's [trainer] table, validated against TrainerConfig when the stack is built."""
    gateway_table: dict[str, Any] = field(default_factory=dict)
    """The config file's [gateway] table (GatewayConfig fields: versions kept loaded, health checks,
    record buffer, ...), validated when the stack is built."""

    def __post_init__(self) -> None:
        self.kafka = KafkaSecurity.of(self.kafka)
        if self.trainer_nproc < 1:
            raise ValueError("trainer_nproc must be >= 1")
        if self.replicas < 1:
            raise ValueError("replicas must be >= 1")
        for name, gpus, count in (("trainer_gpus", self.trainer_gpus, self.trainer_nproc),
                                  ("replica_gpus", self.replica_gpus, self.replicas)):
            if gpus and len(gpus) != count:
                raise ValueError(f"{name} names {len(gpus)} GPUs for {count} "
                                 f"{'trainer ranks' if name == 'trainer_gpus' else 'replicas'}: one each")
        if self.gateways < 1:
            raise ValueError("gateways must be >= 1")
        if self.work_dir is None:
            self.work_dir = str(default_cache_dir() / "runs" / time.strftime("%Y%m%d-%H%M%S"))

    @property
    def run_dir(self) -> Path:
        return Path(str(self.work_dir))

    def engine_config(self, model: str) -> EngineConfig:
        """The [engine] table < what ``up`` owns (the model, the host, token capture)."""
        return EngineConfig(**{**self.engine_table, "model": model, "host": self.host,
                               "token_capture": self.token_capture})

    @property
    def child_kafka(self) -> KafkaSecurity:
        """The Kafka settings written into the parts' config files: without the password, which reaches
        them in the environment (``child_env``)."""
        return dataclasses.replace(self.kafka, sasl_password=None)

    @property
    def child_env(self) -> dict[str, str]:
        k = self.kafka
        return {k.sasl_password_env: k.sasl_password} if k.sasl_password is not None else {}

    def gateway_config(self, upstreams: list[str], bootstrap_servers: str, port: int) -> GatewayConfig:
        """Defaults ``up`` picks (the adapter root: its trainer's adapters; the spool: in the run's directory,
        found again by the next ``up`` on it) < the [gateway] table < what ``up`` owns (upstreams, broker and
        its security, address, topics, policy name, token capture, which the engine shares)."""
        values = {"adapter_root": str(self.run_dir / "adapters"), "spool_dir": str(self.run_dir / "spool"),
                  **self.gateway_table,
                  "upstreams": tuple(upstreams), "bootstrap_servers": bootstrap_servers, "kafka": self.child_kafka,
                  "host": self.host, "port": port, "topic_prefix": self.topic_prefix,
                  "policy_name": self.policy_name, "token_capture": self.token_capture,
                  **({"workers": self.gateways} if self.gateways > 1 else {})}
        return GatewayConfig.load(None, **values)

    def trainer_config(self, model: str, bootstrap_servers: str) -> TrainerConfig:
        """Demo defaults (with --demo) < the [trainer] table < what ``up`` owns (model, broker, paths)."""
        values = dataclasses.asdict(DemoTrainer()) if self.demo is not None else {}
        values.update(self.trainer_table)
        if self.trainer_device is not None:
            values["device"] = self.trainer_device
        if values.get("metrics_port") is None:  # ``up`` watches it to know when the trainer is ready
            values["metrics_port"] = free_port(self.host)
        values.update(model=model, bootstrap_servers=bootstrap_servers, kafka=self.child_kafka,
                      topic_prefix=self.topic_prefix,
                      name=self.policy_name, adapters=str(self.run_dir / "adapters"),
                      history=values.get("history") or str(self.run_dir / "history.jsonl"))
        return TrainerConfig.load(None, **values)


def load_config(path: str | Path | None = None, **flags: Any) -> UpConfig:
    """Defaults, then the file, then the flags that were given (None = not given)."""
    data: dict[str, Any] = {}
    if path:
        data = read_file(path)
        extra = sorted(set(data) - {"up", "engine", "gateway", "trainer", "demo"})
        if extra:
            raise ValueError(f"unknown table(s) in {path}: {', '.join(extra)} "
                             "(use up, engine, gateway, trainer, demo)")
    up = check_fields(UpConfig, data.get("up", {}), "up")
    engine = check_fields(EngineConfig, data.get("engine", {}), "engine")
    owned = sorted(set(engine) & set(ENGINE_OWNED))
    if owned:
        raise ValueError(f"[engine]: {', '.join(owned)} is set by [up] ({', '.join(ENGINE_OWNED)}), not here")
    demo = check_fields(DemoConfig, data.get("demo", {}), "demo")
    engine_flags = {k[len("engine_"):]: flags.pop(k) for k in list(flags) if k.startswith("engine_")}
    demo_flags = {k[len("demo_"):]: flags.pop(k) for k in list(flags) if k.startswith("demo_")}
    want_demo = bool(flags.pop("demo", False)) or "demo" in data
    engine.update({k: v for k, v in engine_flags.items() if v is not None})
    demo.update({k: v for k, v in demo_flags.items() if v is not None})
    if isinstance(flags.get("kafka"), dict) and isinstance(up.get("kafka"), dict):
        flags["kafka"] = {**up["kafka"], **flags["kafka"]}  # --kafka-* flags over the [up.kafka] table
    up.update({k: v for k, v in flags.items() if v is not None})
    return UpConfig(**up, engine_table=engine, demo=DemoConfig(**demo) if want_demo else None,
                    trainer_table=dict(data.get("trainer", {})), gateway_table=dict(data.get("gateway", {})))


# ---------------------------------------------------------------------------------------------- logs


_CLIENT_CHATTER = re.compile(r" (?:DEBUG|INFO) (?:kafka|httpx|aiohttp|urllib3)[.:]")
_ENGINE_TROUBLE = re.compile(r"ERROR|CRITICAL|Traceback|Error\b|Exception")


def console_worthy(part: str, text: str, verbose: bool) -> bool:
    """What reaches the console (every line still goes to the part's log file): not the Kafka/HTTP
    clients' INFO chatter, and of vLLM only its trouble unless ``verbose``."""
    if verbose:
        return True
    if part == "engine" or part.startswith("engine-"):
        return bool(_ENGINE_TROUBLE.search(text))
    return not _CLIENT_CHATTER.search(text)


class CombinedLog:
    """Prefixes each part's lines with its name on stdout, and keeps each part's full log in a file."""

    def __init__(self, out: IO[str] | None = None, verbose: bool = False) -> None:
        self.out = out or sys.stdout
        self.verbose = verbose
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def line(self, part: str, text: str) -> None:
        with self.lock:
            self.out.write(f"{part:<8}| {text.rstrip()}\n")
            self.out.flush()

    def pump(self, part: str, stream: IO[bytes], log_file: Path) -> None:
        """Copy a child's output to its log file and, prefixed, to the console."""
        def run() -> None:
            with open(log_file, "ab") as f:
                for raw in iter(stream.readline, b""):
                    f.write(raw)
                    f.flush()
                    text = raw.decode(errors="replace")
                    if console_worthy(part, text, self.verbose):
                        self.line(part, text)
        self._start(run)

    def follow(self, part: str, log_file: Path, stop: threading.Event) -> None:
        """Follow a log file another component writes (the engine's)."""
        def run() -> None:
            log_file.touch()
            with open(log_file, errors="replace") as f:
                f.seek(0, os.SEEK_END)
                while not stop.is_set():
                    text = f.readline()
                    if not text:
                        time.sleep(0.2)
                    elif console_worthy(part, text, self.verbose):
                        self.line(part, text)
        self._start(run)

    def _start(self, target: Any) -> None:
        t = threading.Thread(target=target, daemon=True)
        t.start()
        self.threads.append(t)


# ------------------------------------------------------------------------------------------- parts


class Shutdown(Exception):
    """Raised in the main thread when SIGINT/SIGTERM arrives (outside a spawn)."""


class SignalGate:
    """Turns SIGINT/SIGTERM into ``Shutdown`` in the main thread, except while a child is being spawned:
    then the signal waits until the child is tracked, so a shutdown never leaves one behind. (Blocking
    the signals with a mask instead would be inherited by the children, which then ignore SIGTERM.)"""

    def __init__(self) -> None:
        self.pending: str | None = None
        self.deferring = 0

    def handler(self, signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        if self.deferring:
            self.pending = name
        else:
            raise Shutdown(name)

    @contextlib.contextmanager
    def defer(self) -> Iterator[None]:
        self.deferring += 1
        try:
            yield
        finally:
            self.deferring -= 1
        if self.pending and not self.deferring:
            raise Shutdown(self.pending)


class Stack:
    """The running parts. ``start()`` brings them up in order; ``stop()`` takes down what was started."""

    def __init__(self, config: UpConfig, log: CombinedLog | None = None, gate: SignalGate | None = None) -> None:
        self.config = config
        self.gate = gate or SignalGate()
        self.log = log or CombinedLog(verbose=config.verbose)
        self.run_dir = config.run_dir
        self.logs = self.run_dir / "logs"
        self.broker: EmbeddedBroker | None = None
        self.engines: list[Engine] = []
        self.children: dict[str, subprocess.Popen] = {}
        self.model = ""
        self.bootstrap_servers = ""
        self.upstreams: list[str] = []
        self.gateway_url = ""
        self.demo_thread: threading.Thread | None = None
        self.demo_stop = threading.Event()
        self.demo_failed: int | None = None
        self._following = threading.Event()

    # start ------------------------------------------------------------------------------------

    def start(self) -> Stack:
        c = self.config
        self._check_access()
        self.logs.mkdir(parents=True, exist_ok=True)
        self.log.line("up", f"run directory {self.run_dir}")
        self.model = self._model()
        self.bootstrap_servers = self._broker()
        trainer = c.trainer_config(self.model, self.bootstrap_servers)  # validated before anything slow
        c.gateway_config(c.upstreams or ["http://127.0.0.1"], self.bootstrap_servers, 1)  # (engine not up yet)
        self._trainer(trainer)
        self.upstreams = self._engine()
        self._gateway()
        if c.judge or (c.demo is not None and c.demo.reward == "judge"):
            self._judge()
        if c.demo is not None:
            demo = c.demo
            if demo.groups_per_step is None:  # pace the demo to the trainer
                demo = dataclasses.replace(demo, groups_per_step=trainer.groups_per_step)
            demo = dataclasses.replace(demo, model=c.policy_name)  # the demo trains the policy this stack serves
            self._wait_trainer(trainer)  # groups generated before the trainer can use them would only age
            self._demo(demo)
        return self

    def _check_access(self) -> None:
        """Before anything starts: the gateway's keys (``gateway/auth.py``) read, and a gateway on an address
        other hosts reach refused without keys unless the [gateway] table says ``insecure``."""
        c = self.config
        gateway = c.gateway_config(c.upstreams or ["http://127.0.0.1"], c.bootstrap_servers or "127.0.0.1:9092", 1)
        keys = load_keys(gateway.api_keys, os.environ)
        check_bind(gateway.host, keys, gateway.insecure)
        if keys and c.demo is not None:
            raise ValueError("the demo producer sends no API key: run --demo on a gateway without api_keys")

    def _model(self) -> str:
        model = self.config.model
        if model in MODELS:  # a real model shipped in a PyPI wheel: converted into the cache on first use
            return resolve(model, default_cache_dir(), lambda s: self.log.line("up", s))
        if model is not None:
            if model.startswith((".", "/", "~")) and not Path(model).expanduser().exists():
                raise FileNotFoundError(f"--model {model}: no such directory (omit --model for the demo model)")
            return str(Path(model).expanduser()) if model.startswith("~") else model
        path = default_cache_dir() / "models" / "tiny-demo"
        self.log.line("up", f"no --model given: using the demo model at {path} (built on first use)")
        return str(build_demo_model(path))

    def _broker(self) -> str:
        c = self.config
        topics = Topics(c.topic_prefix)
        if c.bootstrap_servers:
            create_topics(c.bootstrap_servers, topics, partitions=c.partitions, security=c.kafka)
            self.log.line("broker", f"external Kafka at {c.bootstrap_servers}")
            return c.bootstrap_servers
        with self.gate.defer():
            self.broker = EmbeddedBroker(c.host, c.broker_port, topics=topics, partitions=c.partitions,
                                         log_file=self.logs / "broker.log")
            self.broker.start()
        self.log.line("broker", f"embedded broker ready at {self.broker.bootstrap_servers}")
        return self.broker.bootstrap_servers

    def _spawn(self, part: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        with self.gate.defer():
            proc = spawn(argv, env={**os.environ, **self.config.child_env, **(env or {})}, pipe=True)
            self.children[part] = proc
        assert proc.stdout is not None
        self.log.pump(part, proc.stdout, self.logs / f"{part}.log")
        return proc

    @property
    def _cli(self) -> list[str]:
        """``python`` arguments that run a streamrl command; with ``verbose`` the Kafka client's INFO too."""
        return ["-m", "streamrl.cli", *(["--kafka-log-level", "INFO"] if self.config.verbose else [])]

    def _trainer(self, trainer: TrainerConfig) -> None:
        path = self.run_dir / "trainer.json"
        path.write_text(json.dumps(dataclasses.asdict(trainer), indent=2))
        cli = [*self._cli, "trainer", "--config", str(path)]
        n = self.config.trainer_nproc
        argv = [sys.executable, *cli] if n == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", *cli]
        env = {"PYTHONUNBUFFERED": "1"}
        if self.config.trainer_gpus:  # rank r runs on cuda:LOCAL_RANK, the r-th of these
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.config.trainer_gpus)
        self._spawn("trainer", argv, env=env)

    def _engine(self) -> list[str]:
        c = self.config
        if c.upstreams:
            self.log.line("engine", f"external upstream(s): {', '.join(c.upstreams)}")
            return list(c.upstreams)
        config = c.engine_config(self.model)
        for i in range(c.replicas):  # started side by side, then waited for
            part = "engine" if c.replicas == 1 else f"engine-{i}"
            replica = dataclasses.replace(config, device=c.replica_gpus[i]) if c.replica_gpus else config
            log_file = self.logs / f"{part}.log"
            self.engines.append(engine := Engine(replica, log_file=log_file))
            self.log.follow(part, log_file, self._following)
            where = f" on GPU {replica.device}" if replica.device is not None else ""
            self.log.line(part, f"starting vLLM on {self.model}{where} (log: {log_file})")
            engine.launch(spawning=self.gate.defer())
        for i, engine in enumerate(self.engines):
            engine.wait_healthy(timeout=900)
            self.log.line("engine" if c.replicas == 1 else f"engine-{i}", f"vLLM ready at {engine.url}")
        return [e.url for e in self.engines]

    def _gateway(self) -> None:
        c = self.config
        gateway = c.gateway_config(self.upstreams, self.bootstrap_servers, c.port or free_port(c.host))
        path = self.run_dir / "gateway.json"
        path.write_text(json.dumps(dataclasses.asdict(gateway), indent=2))
        proc = self._spawn("gateway", [sys.executable, *self._cli, "gateway", "--config", str(path)])
        port = gateway.port
        self.gateway_url = f"http://{c.host}:{port}"
        wait_http(self.gateway_url, 120, proc, what="gateway")
        self.log.line("gateway", f"ready at {self.gateway_url}/v1 (model {c.policy_name!r})")
        if gateway.workers > 1:
            self.log.line("gateway", f"{gateway.workers} gateway processes share port {port} (SO_REUSEPORT); spools "
                                     f"{gateway.spool_path}/worker-0..{gateway.workers - 1}; /health and /metrics "
                                     "answer for the process that took the connection (its gateway_id)")
        if gateway.dashboard:
            self.log.line("gateway", f"live dashboard at {self.gateway_url}/dashboard")

    def _judge(self) -> None:
        """``streamrl judge`` on this stack's topics, asking the base model through the gateway."""
        import httpx

        from streamrl.judge.config import JudgeConfig

        c = self.config
        base = httpx.get(f"{self.upstreams[0]}/v1/models", timeout=30).json()["data"][0]["id"]
        judge = JudgeConfig(base_url=f"{self.gateway_url}/v1", model=base, bootstrap_servers=self.bootstrap_servers,
                            topic_prefix=c.topic_prefix, kafka=c.child_kafka, name=f"{c.policy_name}-judge")
        path = self.run_dir / "judge.json"
        path.write_text(json.dumps(dataclasses.asdict(judge), indent=2))
        self._spawn("judge", [sys.executable, *self._cli, "judge", "--config", str(path)],
                    env={"PYTHONUNBUFFERED": "1"})
        self.log.line("judge", f"judging with {base} through the gateway")

    def _wait_trainer(self, trainer: TrainerConfig) -> None:
        """Until the trainer has loaded its model and serves its metrics (rank 0 opens the port then)."""
        started = time.monotonic()
        wait_http(f"http://127.0.0.1:{trainer.metrics_port}", 900, self.children["trainer"], what="trainer",
                  path="/metrics")
        self.log.line("trainer", f"ready (model loaded) after {time.monotonic() - started:.1f} s")

    def _demo(self, demo: DemoConfig) -> None:
        if demo.summary is None:
            demo = dataclasses.replace(demo, summary=str(self.run_dir / "demo-summary.json"))
        if demo.eval_out is None:
            demo = dataclasses.replace(demo, eval_out=str(self.run_dir / "eval.jsonl"))

        def run() -> None:
            board = run_demo(self.gateway_url, demo, stop=self.demo_stop,
                             emit=lambda s: self.log.line("demo", s))
            self.demo_failed = board.failed

        self.log.line("demo", f"task {demo.task!r}: groups of {demo.group_size}, {demo.concurrency} in flight; "
                              "reward per policy version follows")
        self.demo_thread = threading.Thread(target=run, name="demo", daemon=True)
        self.demo_thread.start()

    # run --------------------------------------------------------------------------------------

    def wait(self) -> int:
        """Until a part dies (1), the demo ends (0, or 1 if any trajectory failed) or a signal arrives."""
        while True:
            for part, proc in self.children.items():
                if proc.poll() is not None:
                    self.log.line("up", f"{part} exited with code {proc.returncode}; stopping")
                    return 1
            parts = [(f"engine {e.url}", e.proc) for e in self.engines] + [("broker", self.broker and self.broker.proc)]
            for part, p in parts:
                if p is not None and p.poll() is not None:
                    self.log.line("up", f"{part} exited with code {p.returncode}; stopping")
                    return 1
            if self.demo_thread is not None and not self.demo_thread.is_alive():
                if self.demo_failed is None:
                    self.log.line("up", "demo stopped with an error; stopping")
                    return 1
                return 1 if self.demo_failed else 0
            time.sleep(0.3)

    # stop -------------------------------------------------------------------------------------

    def stop(self) -> None:
        if self.demo_thread is not None:
            self.demo_stop.set()
            self.demo_thread.join(timeout=60)
        for part, timeout in (("judge", 20.0), ("gateway", 20.0), ("trainer", 60.0)):
            proc = self.children.get(part)
            if proc is not None:
                self.log.line("up", f"stopping {part}")
                if stop_group(proc, timeout):
                    self.log.line("up", f"{part} did not stop within {timeout:.0f} s of SIGTERM: killed")
        self._following.set()  # vLLM's own shutdown messages stay in its log file, off the console
        for engine in self.engines:
            self.log.line("up", f"stopping engine {engine.url}")
            engine.stop()
        if self.broker is not None:
            self.log.line("up", "stopping broker")
            self.broker.stop()
        for t in self.log.threads:
            t.join(timeout=2)


# --------------------------------------------------------------------------------------------- CLI


UP_TABLES = ("engine_table", "demo", "trainer_table", "gateway_table")
"""``UpConfig`` fields that are other parts' tables, not flags of their own."""
ENGINE_FLAG_NAMES = {"gpu_memory_utilization": "gpu-memory-utilization", "max_model_len": "max-model-len"}
"""Engine fields whose flag is not ``--engine-<field>``."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML or JSON file with [up], [engine], [gateway], [trainer], [demo] tables")
    add_config_flags(p, UpConfig, skip=UP_TABLES, names={"upstreams": "upstream"})
    add_config_flags(p, EngineConfig, group="engine", skip=ENGINE_OWNED, names=ENGINE_FLAG_NAMES)
    p.add_argument("--demo", action="store_true", help="also run the demo producer and print reward per version")
    add_config_flags(p, DemoConfig, group="demo")


def flags_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The flags given, as ``load_config`` takes them (``engine_<field>``, ``demo_<field>``, ``demo``)."""
    return {**given(args, UpConfig), **{f"engine_{k}": v for k, v in given(args, EngineConfig, "engine").items()},
            **{f"demo_{k}": v for k, v in given(args, DemoConfig, "demo").items()}, "demo": args.demo}


def run(args: argparse.Namespace) -> int:
    for chatty in ("httpx", "kafka"):  # a line per request / connection would drown the combined log
        logging.getLogger(chatty).setLevel(logging.WARNING)
    config = load_config(args.config, **flags_from_args(args))
    gate = SignalGate()
    stack = Stack(config, gate=gate)
    old = {s: signal.signal(s, gate.handler) for s in (signal.SIGINT, signal.SIGTERM)}
    code = 1
    try:
        stack.start()
        code = stack.wait()
    except Shutdown as sig:
        stack.log.line("up", f"{sig}: shutting down")
        code = 0
    except Exception as exc:
        stack.log.line("up", f"error: {type(exc).__name__}: {exc}")
    finally:
        for s in old:  # a second Ctrl-C must not interrupt the orderly stop
            signal.signal(s, signal.SIG_IGN)
        stack.stop()
        for s, handler in old.items():
            signal.signal(s, handler)
    stack.log.line("up", f"stopped (exit code {code})")
    return code
