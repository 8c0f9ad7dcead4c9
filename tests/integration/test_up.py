"""`streamrl up`: configuration (defaults < file < flags), the combined log, the signal gate, and a run
against external services (the session's broker and vLLM) that must stop cleanly on SIGINT."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from streamrl.broker.embedded import EmbeddedBroker, free_port
from streamrl.cli.up import Stack
from streamrl.cli.up_config import DemoTrainer, load_config
from streamrl.cli.up_console import Shutdown, SignalGate, console_worthy
from streamrl.engine.server import Engine

CONFIG = """
[up]
port = 9100
policy_name = "agent"
trainer_device = "cpu"

[engine]
device = "0"
gpu_memory_utilization = 0.4
extra_args = ["--enforce-eager"]

[trainer.optim]
learning_rate = 0.01

[trainer.lora]
rank = 4

[demo]
group_size = 4
"""


def test_config_file_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "up.toml"
    path.write_text(CONFIG)
    c = load_config(path, port=9200, engine_device="1", demo_concurrency=None, model="m", work_dir=str(tmp_path))
    assert c.port == 9200 and c.policy_name == "agent" and c.model == "m"  # flag beats file beats default
    engine = c.engine_config("m")
    assert engine.device == "1" and engine.gpu_memory_utilization == 0.4 and engine.model == "m"
    assert engine.extra_args == ["--enforce-eager"] and engine.host == c.host
    assert c.demo is not None and c.demo.group_size == 4  # a [demo] table turns the demo on
    t = c.trainer_config("m", "127.0.0.1:1")
    assert t.optim.learning_rate == 0.01 and t.lora.rank == 4  # the file beats the demo's defaults...
    assert t.feed.groups_per_step == DemoTrainer().groups_per_step  # ...which fill the rest
    assert t.device == "cpu" and t.name == "agent" and t.model == "m" and t.kafka.bootstrap_servers == "127.0.0.1:1"
    assert t.adapters == str(tmp_path / "adapters") and t.history == str(tmp_path / "history.jsonl")


def test_without_demo_the_trainer_keeps_its_own_defaults(tmp_path: Path) -> None:
    c = load_config(None, model="m", work_dir=str(tmp_path))
    assert c.demo is None and c.kafka.bootstrap_servers is None and c.upstreams == []
    from streamrl.trainer.config import OptimConfig

    assert c.trainer_config("m", "b:1").optim.learning_rate == OptimConfig().learning_rate


@pytest.mark.parametrize("text, error", [
    ("[up]\nprot = 1\n", "unknown option.*prot"),
    ("[engine]\ngpu = 1\n", r"unknown option.*\[engine\]"),
    ("[engine]\nmodel = 'x'\n", r"\[engine\]: model is set by \[up\]"),
    ("[engine]\ntoken_capture = false\n", r"\[engine\]: token_capture is set by \[up\]"),
    ("[trainers]\n", "unknown table"),
    ("[demo]\ntask = 'chess'\n", "demo task"),
    ("[demo]\nreward = 'judge'\n", "demo reward must be exact, or judge with the arithmetic task"),
])
def test_config_errors_are_clear(tmp_path: Path, text: str, error: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=error):
        load_config(path)


def test_the_gateway_table_reaches_the_gateway_and_up_keeps_what_it_owns(tmp_path: Path) -> None:
    path = tmp_path / "up.toml"
    path.write_text('[up]\npolicy_name = "agent"\ntoken_capture = false\n'
                    '[gateway]\nkeep_previous_versions = 0\nhealth_interval_s = 0.25\nport = 1\n')
    c = load_config(path, work_dir=str(tmp_path))
    g = c.gateway_config(["http://e:1"], "b:1", 9300)
    assert (g.keep_previous_versions, g.health_interval_s) == (0, 0.25)  # the table's...
    assert (g.port, g.policy_name, g.token_capture, g.upstreams) == (9300, "agent", False, ("http://e:1",))
    assert not c.engine_config("m").token_capture  # one switch: the engine up starts is a plain vLLM too
    assert g.adapter_root == str(tmp_path / "adapters")  # the gateway serves only what up's trainer wrote
    path.write_text("[gateway]\nmax_loaded_versions = 1\n")  # ...checked by GatewayConfig itself
    with pytest.raises(ValueError, match="max_loaded_versions must be >= 2"):
        load_config(path, work_dir=str(tmp_path)).gateway_config(["http://e:1"], "b:1", 1)


def test_a_public_gateway_without_keys_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """On loopback ``up`` needs no keys; on another address the gateway needs them, or ``insecure``."""
    c = load_config(None, host="0.0.0.0", work_dir=str(tmp_path / "run"))
    env_keys = os.environ.get("STREAMRL_API_KEYS")
    if not env_keys:
        with pytest.raises(ValueError, match="--insecure"):
            Stack(c).start()
        assert not (tmp_path / "run").exists()  # nothing was started (not even the run directory made)
    path = tmp_path / "up.toml"
    path.write_text("[gateway]\ninsecure = true\n")
    Stack(load_config(path, host="0.0.0.0", port=0, work_dir=str(tmp_path / "run"))).preflight()


def test_gateways_sets_the_gateway_workers(tmp_path: Path) -> None:
    assert load_config(None, model="m", work_dir=str(tmp_path)).gateway_config(["http://u"], "b:1", 1).workers == 1
    c = load_config(None, model="m", work_dir=str(tmp_path), gateways=3)
    assert c.gateway_config(["http://u"], "b:1", 1).workers == 3
    path = tmp_path / "up.toml"
    path.write_text("[gateway]\nworkers = 2\n")
    assert load_config(path, work_dir=str(tmp_path)).gateway_config(["http://u"], "b:1", 1).workers == 2
    with pytest.raises(ValueError, match="gateways must be >= 1"):
        load_config(None, work_dir=str(tmp_path), gateways=0)


def test_bad_trainer_table_fails_before_anything_starts(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[trainer]\nlearning_rat = 1\n")
    with pytest.raises(ValueError, match=r"bad.toml:2:1: unknown option 'learning_rat' in \[trainer\] \(did you mean"):
        load_config(path, work_dir=str(tmp_path))


def test_console_filter() -> None:
    assert console_worthy("trainer", "INFO streamrl.trainer: v3 step 3 | reward 0.5", verbose=False)
    assert not console_worthy("trainer", "2026 INFO kafka.net.connection: Connected", verbose=False)
    assert console_worthy("trainer", "2026 INFO kafka.net.connection: Connected", verbose=True)
    assert not console_worthy("engine", "(APIServer pid=1) INFO 11-29 [api_server.py] Started", verbose=False)
    assert console_worthy("engine", "(APIServer pid=1) ERROR 11-29 engine died", verbose=False)


def test_signal_gate_defers_during_a_spawn() -> None:
    gate = SignalGate()
    with pytest.raises(Shutdown, match="SIGTERM"):
        gate.handler(signal.SIGTERM, None)
    spawned = False
    with pytest.raises(Shutdown, match="SIGINT"), gate.defer():
        gate.handler(signal.SIGINT, None)  # arrives mid-spawn: held back...
        spawned = True  # ...so the spawn completes and is tracked
    assert spawned


@contextlib.contextmanager
def _up(cmd: list[str], log_path: Path) -> Iterator[subprocess.Popen]:
    """``streamrl up`` in its own process group, its output in ``log_path``; killed on the way out if still running."""
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _wait_for_line(proc: subprocess.Popen, log_path: Path, line: str, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while line not in log_path.read_text():
        assert proc.poll() is None, log_path.read_text()[-3000:]
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def _leftovers(marker: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if marker in line and "ps -eo" not in line]


def test_external_broker_and_upstream_then_ctrl_c(tmp_path: Path, tiny_model: Path, broker: EmbeddedBroker,
                                                 engine: Engine) -> None:
    """With --bootstrap-servers and --upstream, up starts only the gateway (two processes on its port,
    ``--gateways 2``) and the trainers, one per policy (``--policies sql``), and, with --judge, the judge; the
    gateway serves both policies through the external vLLM; SIGINT stops them all (no SIGKILL needed) and
    leaves nothing behind."""
    port = free_port()
    cmd = [sys.executable, "-m", "streamrl.cli", "up", "--model", str(tiny_model), "--port", str(port),
           "--work-dir", str(tmp_path), "--bootstrap-servers", broker.bootstrap_servers,
           "--upstream", engine.url, "--topic-prefix", "uptest", "--trainer-device", "cpu", "--judge",
           "--gateways", "2", "--policies", "sql"]
    with _up(cmd, tmp_path / "up.log") as proc:
        _wait_for_line(proc, tmp_path / "up.log", "judge   | judging with", "gateway not ready", 300)
        for model in ("policy", "sql"):
            reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60, json={
                "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            assert reply.status_code == 200 and reply.headers["X-Policy-Version"] == "0"
        for name in ("policy", "sql"):  # a trainer per policy, each its own adapters, consumer group and port
            trainer_cfg = json.loads((tmp_path / f"trainer-{name}.json").read_text())
            assert trainer_cfg["kafka"]["topic_prefix"] == "uptest"
            assert trainer_cfg["kafka"]["bootstrap_servers"] == broker.bootstrap_servers
            assert trainer_cfg["name"] == name and trainer_cfg["adapters"] == str(tmp_path / "adapters" / name)
        judge_cfg = json.loads((tmp_path / "judge.json").read_text())
        assert judge_cfg["base_url"] == f"http://127.0.0.1:{port}/v1" and judge_cfg["kafka"]["topic_prefix"] == "uptest"
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        assert proc.wait(timeout=120) == 0
    text = (tmp_path / "up.log").read_text()
    assert "engine  | external upstream" in text and "external Kafka" in text
    assert f"live dashboard at http://127.0.0.1:{port}/dashboard" in text
    assert f"2 gateway processes share port {port} (SO_REUSEPORT)" in text
    assert "embedded broker ready" not in text and "starting vLLM" not in text
    assert "(models 'policy' 'sql')" in text and "stopping judge, gateway, trainer-policy, trainer-sql" in text
    assert "SIGINT: shutting down" in text and not re.search(r"(gateway|trainer)\S* still running .* killed", text)
    assert _leftovers(str(tmp_path)) == []


def test_no_train_serves_what_a_learner_of_ones_own_publishes(tmp_path: Path, tiny_model: Path,
                                                               broker: EmbeddedBroker, engine: Engine,
                                                               adapters: list[Path]) -> None:
    """``--no-train``: up starts the gateway and no trainer; an adapter written under the run's ``adapters/`` and
    published with ``streamrl publish`` (what an outside learner does) is swapped in and served."""
    import shutil

    port = free_port()
    cmd = [sys.executable, "-m", "streamrl.cli", "up", "--model", str(tiny_model), "--port", str(port),
           "--work-dir", str(tmp_path), "--bootstrap-servers", broker.bootstrap_servers,
           "--upstream", engine.url, "--topic-prefix", "upnotrain", "--policy-name", "own", "--no-train"]
    gw = f"http://127.0.0.1:{port}"
    with _up(cmd, tmp_path / "up.log") as proc:
        _wait_for_line(proc, tmp_path / "up.log", "gateway | ready at", "gateway not ready", 120)
        adapter = tmp_path / "adapters" / "own" / "v1"
        shutil.copytree(adapters[0], adapter)
        published = subprocess.run([sys.executable, "-m", "streamrl.cli", "publish", str(adapter), "--name", "own",
                                    "--base-model", str(tiny_model), "--bootstrap-servers", broker.bootstrap_servers,
                                    "--topic-prefix", "upnotrain"], capture_output=True, text=True, timeout=60)
        assert published.returncode == 0, published.stderr
        deadline = time.monotonic() + 60
        while httpx.get(f"{gw}/health", timeout=10).json()["policies"]["own"]["version"] != 1:
            assert time.monotonic() < deadline, "the published version was not routed"
            time.sleep(0.1)
        reply = httpx.post(f"{gw}/v1/chat/completions", timeout=60, json={
            "model": "own", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert reply.status_code == 200 and reply.headers["X-Policy-Version"] == "1"
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    text = (tmp_path / "up.log").read_text()
    assert "no trainer (--no-train)" in text and re.search(r"stopping gateway$", text, re.M)
    assert not (tmp_path / "trainer.json").exists() and "trainer |" not in text
