"""Experiment tracking (``--report-to``): the real ``streamrl trainer`` trains two steps on records in the
embedded broker and logs each step to Weights & Biases (``WANDB_MODE=offline``: a local run, no account)
and to TensorBoard; both are read back."""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.kafka_reader import produce
from support.trainer_records import group_records, new_topics

from streamrl.broker.embedded import EmbeddedBroker
from streamrl.trainer.config import TrainerConfig

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("wandb") is None or importlib.util.find_spec("tensorboard") is None,
    reason="needs the tracking extra (wandb, tensorboard): pip install -e '.[tracking]' (the dev extra has them)")


def test_unknown_tracker_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown tracker 'mlflow'"):
        TrainerConfig(report_to=("mlflow",))
    assert TrainerConfig().report_to == ()  # off by default


def test_steps_reach_wandb_and_tensorboard(tiny_model: Path, broker: EmbeddedBroker, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    topics = new_topics(broker.bootstrap_servers)
    rng = np.random.default_rng(1)
    produce(broker.bootstrap_servers, topics, [r for g in ("a", "b") for r in group_records(g, rng)])
    tracking = tmp_path / "tracking"
    cmd = [sys.executable, "-m", "streamrl.cli", "trainer", "--model", str(tiny_model), "--device", "cpu",
           "--bootstrap-servers", broker.bootstrap_servers, "--topic-prefix", topics.prefix,
           "--adapters", str(tmp_path / "adapters"), "--groups-per-step", "1", "--max-step-tokens", "0",
           "--max-steps", "2", "--report-to", "wandb", "--report-to", "tensorboard",
           "--tracking-dir", str(tracking), "--run-name", "tracked", "--history", str(tmp_path / "history.jsonl")]
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    history = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == [1, 2]

    [events] = list((tracking / "tensorboard").glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(events.parent))
    acc.Reload()
    rewards = acc.Scalars("reward_mean")
    assert [e.step for e in rewards] == [1, 2]
    assert [e.value for e in rewards] == pytest.approx([h["reward_mean"] for h in history])
    assert {"loss", "tokens_per_s", "staleness_mean", "version"} <= set(acc.Tags()["scalars"])

    [run] = list((tracking / "wandb" / "wandb").glob("offline-run-*/run-*.wandb"))
    records = wandb_records(run)
    logged = {r.history.step.num: {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
              for r in records if r.WhichOneof("record_type") == "history"}
    assert sorted(logged) == [1, 2]
    assert [logged[s]["reward_mean"] for s in (1, 2)] == pytest.approx([h["reward_mean"] for h in history])
    assert logged[2]["version"] == 2 and "kafka_lag" in logged[2]
    [run_record] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run_record.display_name == "tracked" and run_record.project == "streamrl"


def wandb_records(path: Path) -> list[Any]:
    """The records of an offline run's ``.wandb`` file (what ``wandb sync`` uploads): a 7-byte file header,
    then LevelDB-log-style 32 KiB blocks of chunks (crc32, length, type: full/first/middle/last), each
    record one ``wandb_internal_pb2.Record``. wandb reads these files in its Go core; this is the reader
    the test needs to see what was logged without an account."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", "not a wandb run file"
    pos, block, chunk, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            out.append(record)
            chunk = b""
    return out
