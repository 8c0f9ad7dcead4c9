"""`streamrl up`'s configuration: defaults, then one TOML/JSON file (tables ``[up]``, ``[engine]``, ``[gateway]``,
``[trainer]``, ``[demo]``), then flags, every table checked before anything starts. The ``[gateway]`` and
``[trainer]`` tables hold ``GatewayConfig`` and ``TrainerConfig`` fields (the trainer's concerns in
``[trainer.lora]``-style tables); ``UpConfig`` adds what ``up`` owns and makes each part's configuration."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streamrl.broker.embedded import free_port
from streamrl.broker.schema import policy_names
from streamrl.broker.security import OptionalKafkaSettings
from streamrl.config_file import check_fields, flatten, nest, read_file
from streamrl.engine.lora_slots import lora_slots
from streamrl.engine.server import EngineConfig
from streamrl.gateway.config import GatewayConfig, UpdateMode
from streamrl.packaged_models import MODELS, settings_for
from streamrl.producers.demo_cli import DemoConfig
from streamrl.producers.demo_model import default_cache_dir
from streamrl.trainer.config import TrainerConfig
from streamrl.usage import UsageError, as_usage_error


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
    a run that then reached 0.95 (docs/trainer.md, "Divergence"); their 4-step mean stayed under 3.0, and with
    its worst step left out (as the detector does in windows of 3 or more) so did that of a run whose fourth step
    reached 7.8."""


GATEWAY_SHUTDOWN_GRACE_S = 4.0
"""The gateway's ``shutdown_grace_s`` under ``up`` (unless the [gateway] table sets it): calls still in flight
this long after a stop began are cut, leaving the rest of its deadline to deliver what it recorded."""

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



def check_lora_slots(engine: EngineConfig, policies: int, max_loaded_versions: int) -> None:
    """The engine's LoRA slots against what ``policies`` policies keep loaded (``lora_slots``): a CPU cache
    smaller than their loaded versions, or fewer GPU slots than policies, is a ``UsageError`` naming the
    setting to change (between those and ``lora_slots``' GPU count the engine serves, with waits that its
    gateway's warning names: an ``[engine]`` table may trade them for GPU memory)."""
    gpu, cpu = lora_slots(policies, max_loaded_versions)
    what = f"{policies} polic{'ies' if policies > 1 else 'y'} x max_loaded_versions {max_loaded_versions}"
    if engine.max_cpu_loras < cpu:
        raise UsageError(f"[engine] max_cpu_loras = {engine.max_cpu_loras} holds fewer adapters than the {cpu} versions "
                         f"{what} keep loaded: set it to {cpu} or more, or lower [gateway] max_loaded_versions")
    if engine.max_loras < policies:
        raise UsageError(f"[engine] max_loras = {engine.max_loras} is fewer GPU LoRA slots than the {policies} "
                         f"policies served at once: set it to {gpu} (one per loaded version: pinned requests keep "
                         f"every loaded version running)")

