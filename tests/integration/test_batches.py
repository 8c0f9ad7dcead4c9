"""``streamrl.batches`` and ``streamrl batches`` against the real embedded broker: a learner of its own,
killed -9 at the two moments that matter, trains every group exactly once; the out-of-process stream hands
out each step as Arrow IPC (a file per step, or a stream on stdout) and, restarted, the same batch again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
from safetensors.torch import load_file
from support.kafka_reader import produce
from support.trainer_records import group_records, new_topics, policy_records

from streamrl.trainer.batch import Batch, batch_seq
from streamrl.trainer.batch_io import read_ipc_file, read_ipc_stream

LEARNER = '''
import json, os, signal, sys
from pathlib import Path
import streamrl

bootstrap, prefix, work, total = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
die = dict(arg.split("=") for arg in sys.argv[5:])  # {"before_checkpoint"|"after_checkpoint": "<step>"}
ckpt = work / "ckpt.json"
mine = json.loads(ckpt.read_text()) if ckpt.exists() else {"version": 0, "groups": []}
stream = streamrl.batches(bootstrap_servers=bootstrap, topic_prefix=prefix, state_dir=str(work / "stream"),
                          groups_per_step=1, max_step_tokens=0, max_lag=8, poll_timeout_s=0.2,
                          version=mine["version"])
for batch in stream:
    step = mine["version"] + 1
    groups = streamrl.Batch.of(batch).group_ids
    if die.get("before_checkpoint") == str(step):
        os.kill(os.getpid(), signal.SIGKILL)
    mine = {"version": step, "groups": mine["groups"] + groups}
    tmp = work / "ckpt.tmp"
    with open(tmp, "w") as f:
        json.dump(mine, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, ckpt)
    if die.get("after_checkpoint") == str(step):
        os.kill(os.getpid(), signal.SIGKILL)
    stream.ack(batch, step)
    if len(mine["groups"]) >= total:
        break
stream.close()
'''


def run_learner(script: Path, bootstrap: str, prefix: str, work: Path, total: int, *die: str) -> int:
    proc = subprocess.run([sys.executable, str(script), bootstrap, prefix, str(work), str(total), *die],
                          capture_output=True, timeout=120)
    assert proc.returncode in (0, -signal.SIGKILL), proc.stderr.decode()[-3000:]
    return proc.returncode


def test_an_outside_learner_killed_9_trains_every_group_exactly_once(broker, tmp_path) -> None:
    topics = new_topics(broker.bootstrap_servers)
    rng = np.random.default_rng(5)
    groups = [f"b{i}" for i in range(5)]
    produce(broker.bootstrap_servers, topics, [r for g in groups for r in group_records(g, rng)])
    script = tmp_path / "learner.py"
    script.write_text(LEARNER)
    args = (script, broker.bootstrap_servers, topics.prefix, tmp_path, len(groups))

    # killed after its checkpoint of step 2, before acknowledging it: the restart must not train it again
    assert run_learner(*args, "after_checkpoint=2") == -signal.SIGKILL
    ckpt = json.loads((tmp_path / "ckpt.json").read_text())
    assert ckpt["version"] == 2 and json.loads((tmp_path / "stream" / "feed_ack.json").read_text())["version"] == 1
    # killed with step 4's batch in hand, before its checkpoint: the restart must train that batch's group
    assert run_learner(*args, "before_checkpoint=4") == -signal.SIGKILL
    assert json.loads((tmp_path / "ckpt.json").read_text())["version"] == 3
    assert run_learner(*args) == 0
    ckpt = json.loads((tmp_path / "ckpt.json").read_text())
    assert sorted(ckpt["groups"]) == groups and ckpt["version"] == 5  # every group once: none twice, none lost


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the process ended ({proc.returncode}) before {what}: "
                                 f"{proc.stderr.read().decode()[-3000:] if proc.stderr else ''}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def write_ack(path: Path, seq: int, version: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"seq": seq, "version": version}))
    os.replace(tmp, path)


def serve(bootstrap: str, prefix: str, state: Path, to: str, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "streamrl.cli", "batches", "--to", to, "--bootstrap-servers", bootstrap,
           "--topic-prefix", prefix, "--state-dir", str(state), "--groups-per-step", "1", "--max-step-tokens", "0",
           "--max-lag", "8", "--poll-timeout-s", "0.2", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)


def test_the_out_of_process_stream_hands_out_arrow_ipc_and_again_after_a_kill(broker, tmp_path) -> None:
    topics = new_topics(broker.bootstrap_servers)
    rng = np.random.default_rng(6)
    groups = [f"o{i}" for i in range(3)]
    produce(broker.bootstrap_servers, topics, [r for g in groups for r in group_records(g, rng)])
    steps, state = tmp_path / "steps", tmp_path / "state"
    proc = serve(broker.bootstrap_servers, topics.prefix, state, str(steps))
    trained: list[str] = []
    try:
        first = steps / f"{1:010d}.arrow"
        wait_for(first.exists, 120, "the first step's file", proc)
        record = read_ipc_file(first)
        assert batch_seq(record) == 1 and Batch.of(record).sampled_tokens() > 0
        trained += Batch.of(record).group_ids
        write_ack(steps / "ack.json", 1, 1)
        second = steps / f"{2:010d}.arrow"
        wait_for(second.exists, 60, "the second step's file", proc)
        handed_out = read_ipc_file(second)
        os.killpg(proc.pid, signal.SIGKILL)  # batch 2 is out, not acknowledged
        proc.wait()
        second.unlink()
        proc = serve(broker.bootstrap_servers, topics.prefix, state, str(steps), "--max-steps", "1")
        wait_for(second.exists, 120, "batch 2 handed out again", proc)
        again = read_ipc_file(second)
        assert again.equals(handed_out) and batch_seq(again) == 2  # the same batch, bit for bit
        trained += Batch.of(again).group_ids
        write_ack(steps / "ack.json", 2, 2)
        assert proc.wait(timeout=60) == 0
        assert not first.exists()  # acknowledged files are the learner's: removed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # the same stream on stdout: one IPC stream, the sequence number on each message
    ack = tmp_path / "ack.json"
    write_ack(ack, 2, 2)
    proc = serve(broker.bootstrap_servers, topics.prefix, state, "-", "--ack", str(ack), "--max-steps", "1")
    try:
        assert proc.stdout is not None
        reader = read_ipc_stream(pa.PythonFile(proc.stdout, mode="r"))
        third = next(reader)
        assert batch_seq(third) == 3
        trained += Batch.of(third).group_ids
        write_ack(ack, 3, 3)
        assert list(reader) == [] and proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert sorted(trained) == groups


def docs_example() -> str:
    """The learner of docs/trainer.md, "Bring your own learner", exactly as printed there."""
    text = (Path(__file__).parents[2] / "docs" / "trainer.md").read_text()
    start = text.index("```python\n# learner.py") + len("```python\n")
    return text[start:text.index("\n```", start) + 1]


def test_the_documented_learner_trains_acknowledges_and_publishes(tiny_model, broker, tmp_path) -> None:
    topics = new_topics(broker.bootstrap_servers)
    rng = np.random.default_rng(7)
    groups = [f"d{i}" for i in range(4)]
    produce(broker.bootstrap_servers, topics, [r for g in groups for r in group_records(g, rng)])
    script = tmp_path / "learner.py"
    script.write_text(docs_example())
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run([sys.executable, str(script), "--model", str(tiny_model), "--bootstrap-servers",
                           broker.bootstrap_servers, "--topic-prefix", topics.prefix, "--work", str(tmp_path / "run"),
                           "--steps", "2"], capture_output=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    run = tmp_path / "run"
    assert sorted(json.loads((run / "v2" / "trained.json").read_text())) == groups  # 2 steps of 2 groups, once each
    assert json.loads((run / "stream" / "feed_ack.json").read_text()) == {"seq": 2, "version": 2}
    weights = load_file(run / "v2" / "adapter_model.safetensors")
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in weights.items())  # B starts at 0: it trained
    records = policy_records(broker.bootstrap_servers, topics)
    assert [(r.version, Path(r.path)) for r in records] == [(1, (run / "v1").resolve()), (2, (run / "v2").resolve())]
