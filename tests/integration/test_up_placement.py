"""`streamrl up` placing several vLLM replicas and several trainer ranks by configuration (issue #17's code
path on the CPU: gloo ranks instead of NCCL, vLLM CPU servers instead of one per GPU). The same
configuration with ``replica_gpus`` / ``trainer_gpus`` places them on GPUs (docs/loop.md)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from support.up_run import run_up

from streamrl.cli.up_config import load_config
from streamrl.producers.demo_model import build_demo_model

CONFIG = """
[up]
replicas = 2
trainer_nproc = 2
trainer_device = "cpu"

[engine]
cpu_kv_cache_gb = 1

[demo]
until_version = 2
stop_groups = 2
max_seconds = 300
"""


def test_placement_is_checked_before_anything_starts(tmp_path: Path) -> None:
    path = tmp_path / "up.toml"
    path.write_text('[up]\nreplicas = 2\nreplica_gpus = ["0"]\n')
    with pytest.raises(ValueError, match="replica_gpus names 1 GPUs for 2 replicas"):
        load_config(path)
    path.write_text('[up]\ntrainer_nproc = 2\ntrainer_gpus = ["1", "2", "3"]\n')
    with pytest.raises(ValueError, match="trainer_gpus names 3 GPUs for 2 trainer ranks"):
        load_config(path)
    c = load_config(path, trainer_gpus=["2", "3"], replicas=2, replica_gpus=["0", "1"])
    assert c.trainer_gpus == ["2", "3"] and c.replica_gpus == ["0", "1"]


def test_two_replicas_and_two_trainer_ranks(tmp_path: Path) -> None:
    """Two engines and a two-rank trainer: both ranks train, every published version is loaded into both
    replicas before it is routed, both replicas serve the demo's requests, and everything stops."""
    model = build_demo_model(tmp_path / "demo-model")
    work = tmp_path / "run"
    summary = tmp_path / "summary.json"
    (tmp_path / "up.toml").write_text(CONFIG)
    code, text = run_up(["--config", str(tmp_path / "up.toml"), "--model", str(model), "--port", "0",
                         "--work-dir", str(work), "--demo", "--demo-summary", str(summary)],
                        tmp_path / "up.log", timeout=600)
    assert code == 0, text[-5000:]
    assert "stopped (exit code 0)" in text and not re.search(r"(gateway|trainer) still running .* killed", text)
    assert "Traceback" not in text and "trainer | trainer ranks stopped (SIGTERM)" in text, \
        "a two-rank trainer stops as quietly as one: torchrun's SignalException is not a traceback"

    ranks = set(re.findall(r"rank (\d)/2 on cpu", (work / "logs" / "trainer.log").read_text()))
    assert ranks == {"0", "1"}, "both trainer ranks must start, in one world of 2"
    result = json.loads(summary.read_text())
    assert result["failed"] == 0 and max(int(v) for v in result["versions"]) >= 2

    routed = [int(v) for v in re.findall(r"now served by policy@v(\d+)", (work / "logs" / "gateway.log").read_text())]
    assert routed and max(routed) >= 2
    for replica in ("engine-0", "engine-1"):
        engine_log = (work / "logs" / f"{replica}.log").read_text()
        assert f"{replica}| vLLM ready at" in text
        loads = len(re.findall(r'POST /v1/load_lora_adapter HTTP/1.1" 200', engine_log))
        assert loads >= len(set(routed)), f"{replica} loaded {loads} adapters for {len(set(routed))} routed versions"
        assert len(re.findall(r'POST /v1/chat/completions HTTP/1.1" 200', engine_log)) > 0, \
            f"{replica} served no request: the gateway must spread the load"
