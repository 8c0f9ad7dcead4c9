"""``streamrl.batches`` and ``streamrl batches`` against the real embedded broker: a learner of its own,
killed -9 at the two moments that matter, trains every group exactly once; the out-of-process stream hands
out each step as Arrow IPC (a file per step, or a stream on stdout) and, restarted, the same batch again;
a learner acknowledging over HTTP (``--ack-port``) is exactly-once as well, and a wrong acknowledgement is
refused with a 4xx saying why; the documented learner's versions are hot-swapped by a gateway."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
from safetensors.torch import load_file
from support.kafka_reader import produce
from support.trainer_records import group_records, new_topics, policy_records

from streamrl.broker.embedded import free_port
from streamrl.gateway.config import GatewayConfig, GatewayKafka
from streamrl.gateway.server import GatewayServer
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


HTTP_LEARNER = '''
import json, os, signal, sys, time, urllib.error, urllib.request
from pathlib import Path
import pyarrow as pa  # any Arrow reader and HTTP client will do: no streamrl here

url, steps, work, total = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
die = dict(arg.split("=") for arg in sys.argv[5:])  # {"before_checkpoint"|"after_checkpoint": "<step>"}

def ack(seq, version):
    """POST /ack until the stream answers (it may be restarting); anything but 200 is a bug here."""
    body = json.dumps({"seq": seq, "adapter_version": version}).encode()
    for _ in range(600):
        try:
            with urllib.request.urlopen(urllib.request.Request(url + "/ack", body, method="POST")) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise SystemExit(f"ack {seq} refused: {e.code} {e.read().decode()}")
        except OSError:
            time.sleep(0.05)
    raise SystemExit("the stream never answered")

ckpt = work / "ckpt.json"
mine = json.loads(ckpt.read_text()) if ckpt.exists() else {"seq": 0, "version": 0, "groups": []}
if mine["seq"]:
    ack(mine["seq"], mine["version"])  # what the checkpoint holds: acknowledged now, or again (a no-op)
while len(mine["groups"]) < total:
    path = steps / f"{mine['seq'] + 1:010d}.arrow"
    while not path.exists():
        time.sleep(0.02)
    batch = pa.ipc.open_file(str(path)).read_all()
    seq, groups = int(batch.schema.metadata[b"streamrl.seq"]), batch.column("group_id").to_pylist()
    step = mine["version"] + 1
    if die.get("before_checkpoint") == str(step):
        os.kill(os.getpid(), signal.SIGKILL)
    mine = {"seq": seq, "version": step, "groups": mine["groups"] + list(dict.fromkeys(groups))}
    tmp = work / "ckpt.tmp"
    with open(tmp, "w") as f:
        json.dump(mine, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, ckpt)
    if die.get("after_checkpoint") == str(step):
        os.kill(os.getpid(), signal.SIGKILL)
    assert ack(mine["seq"], step) == {"seq": mine["seq"], "adapter_version": step, "already": False}
'''


def test_an_http_acknowledging_learner_killed_9_trains_every_group_exactly_once(broker, tmp_path) -> None:
    """The learner acknowledges with ``POST /ack``; it is killed -9 after a checkpoint (before its ack) and
    with a batch in hand, and the stream itself is killed -9 twice with a batch out: every group once."""
    topics = new_topics(broker.bootstrap_servers)
    rng = np.random.default_rng(8)
    groups = [f"h{i}" for i in range(4)]
    produce(broker.bootstrap_servers, topics, [r for g in groups for r in group_records(g, rng)])
    steps, state, work = tmp_path / "steps", tmp_path / "state", tmp_path / "learner"
    work.mkdir()
    script = tmp_path / "learner.py"
    script.write_text(HTTP_LEARNER)
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    def learner(*die: str) -> int:
        proc = subprocess.run([sys.executable, str(script), url, str(steps), str(work), str(len(groups)), *die],
                              capture_output=True, timeout=120)
        assert proc.returncode in (0, -signal.SIGKILL), proc.stderr.decode()[-3000:]
        return proc.returncode

    def checkpoint() -> dict:
        return json.loads((work / "ckpt.json").read_text())

    stream = serve(broker.bootstrap_servers, topics.prefix, state, str(steps), "--ack-port", str(port))
    try:
        assert learner("after_checkpoint=2") == -signal.SIGKILL  # batch 2 checkpointed, not acknowledged
        assert checkpoint()["seq"] == 2 and read_ack_file(state / "feed_ack.json") == (1, 1)
        assert learner("before_checkpoint=3") == -signal.SIGKILL  # its restart acknowledged 2; 3 in hand
        assert checkpoint()["seq"] == 2 and read_ack_file(steps / "ack.json") == (2, 2)
        for _ in range(2):  # the stream killed with batch 3 out, twice: each restart hands it out again
            wait_for(lambda: httpx.get(f"{url}/health").json()["awaiting"] == 3, 30, "batch 3 out", stream)
            os.killpg(stream.pid, signal.SIGKILL)
            stream.wait()
            (steps / f"{3:010d}.arrow").unlink()
            stream = serve(broker.bootstrap_servers, topics.prefix, state, str(steps), "--ack-port", str(port))
            wait_for((steps / f"{3:010d}.arrow").exists, 60, "batch 3 handed out again", stream)
        assert learner() == 0
        assert sorted(checkpoint()["groups"]) == groups and checkpoint()["version"] == 4  # each once
        assert read_ack_file(state / "feed_ack.json") == (4, 4) == read_ack_file(steps / "ack.json")
        assert httpx.get(f"{url}/health").json() == {"status": "ok", "awaiting": None,
                                                      "acknowledged": {"seq": 4, "adapter_version": 4}}
        stream.send_signal(signal.SIGTERM)
        assert stream.wait(timeout=30) == 0
    finally:
        if stream.poll() is None:
            os.killpg(stream.pid, signal.SIGKILL)
            stream.wait()


def test_http_acknowledgements_that_cannot_be_taken_get_a_4xx_saying_why(broker, tmp_path) -> None:
    topics = new_topics(broker.bootstrap_servers)
    rng = np.random.default_rng(9)
    produce(broker.bootstrap_servers, topics, group_records("x0", rng))
    steps, state, port = tmp_path / "steps", tmp_path / "state", free_port()
    url = f"http://127.0.0.1:{port}"
    stream = serve(broker.bootstrap_servers, topics.prefix, state, str(steps), "--ack-port", str(port))
    try:
        wait_for((steps / f"{1:010d}.arrow").exists, 60, "batch 1", stream)
        assert httpx.get(f"{url}/health").json() == {"status": "ok", "awaiting": 1, "acknowledged": None}

        def ack(body: object, status: int, says: str = "") -> dict:
            r = httpx.post(f"{url}/ack", content=body if isinstance(body, bytes) else json.dumps(body).encode())
            assert r.status_code == status and says in r.json().get("error", ""), (body, r.status_code, r.text)
            return r.json()

        ack(b"{seq: 1", 400, "not JSON")
        ack([1, 1], 400, "JSON object")
        ack({"seq": 1}, 400, "adapter_version is missing")
        ack({"seq": "1", "adapter_version": 1}, 400, "seq must be an integer")
        ack({"seq": 1, "adapter_version": True}, 400, "adapter_version must be an integer")
        ack({"seq": 1, "adapter_version": 1, "step": 3}, 400, "unknown fields ['step']")
        ack({"seq": 2, "adapter_version": 1}, 409, "batch 2 has not been handed out (the newest is batch 1)")
        assert httpx.post(f"{url}/ack", content=b"x" * 5000).status_code == 413
        assert httpx.get(f"{url}/ack").status_code == 405 and httpx.post(f"{url}/nope").status_code == 404
        assert not (state / "feed_ack.json").exists() or read_ack_file(state / "feed_ack.json") == (0, 0)

        assert ack({"seq": 1, "adapter_version": 3}, 200) == {"seq": 1, "adapter_version": 3, "already": False}
        assert read_ack_file(state / "feed_ack.json") == (1, 3) == read_ack_file(steps / "ack.json")
        assert ack({"seq": 1, "version": 3}, 200)["already"]  # a retry after a lost answer: the same answer
        ack({"seq": 1, "adapter_version": 4}, 409, "batch 1 is already acknowledged at version 3")
        produce(broker.bootstrap_servers, topics, group_records("x1", rng))
        wait_for((steps / f"{2:010d}.arrow").exists, 60, "batch 2", stream)
        ack({"seq": 2, "adapter_version": 2}, 409, "version 2 goes backwards")
        ack({"seq": 2, "adapter_version": 3}, 200)  # a version may repeat (several steps per checkpoint)
        ack({"seq": 1, "adapter_version": 3}, 409, "batch 1 is older than batch 2")
        assert read_ack_file(state / "feed_ack.json") == (2, 3)
        assert httpx.get(f"{url}/health").json()["acknowledged"] == {"seq": 2, "adapter_version": 3}
        stream.send_signal(signal.SIGTERM)
        assert stream.wait(timeout=30) == 0
    finally:
        if stream.poll() is None:
            os.killpg(stream.pid, signal.SIGKILL)
            stream.wait()


def read_ack_file(path: Path) -> tuple[int, int]:
    ack = json.loads(path.read_text())
    return ack["seq"], ack["version"]


def docs_example() -> str:
    """The learner of docs/trainer.md, "Bring your own learner", exactly as printed there."""
    text = (Path(__file__).parents[2] / "docs" / "trainer.md").read_text()
    start = text.index("```python\n# learner.py") + len("```python\n")
    return text[start:text.index("\n```", start) + 1]


def test_the_documented_learner_trains_acknowledges_and_publishes(tiny_model, broker, engine, tmp_path) -> None:
    """...and a gateway following the policy, started with it, hot-swaps to the version it published last."""
    topics = new_topics(broker.bootstrap_servers)
    rng = np.random.default_rng(7)
    groups = [f"d{i}" for i in range(4)]
    produce(broker.bootstrap_servers, topics, [r for g in groups for r in group_records(g, rng)])
    script = tmp_path / "learner.py"
    script.write_text(docs_example())
    name = f"byo{uuid.uuid4().hex[:6]}"  # the engine is the session's: a name of this test's own
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    gateway = GatewayConfig(upstreams=(engine.url,),
                            kafka=GatewayKafka(bootstrap_servers=broker.bootstrap_servers, topic_prefix=topics.prefix),
                            port=free_port(), policy_name=name, health_interval_s=0.5)
    proc = subprocess.Popen([sys.executable, str(script), "--model", str(tiny_model), "--bootstrap-servers",
                             broker.bootstrap_servers, "--topic-prefix", topics.prefix, "--name", name,
                             "--work", str(tmp_path / "run"), "--steps", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        with GatewayServer(gateway) as gw:  # started while the learner starts
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err.decode()[-3000:]
            deadline = time.monotonic() + 60
            while gw.gateway.router.version != 2:
                assert time.monotonic() < deadline, f"the gateway did not route {name}@v2"
                time.sleep(0.02)
            answer = httpx.post(f"{gw.url}/v1/completions", json={"model": name, "prompt": "a", "max_tokens": 2},
                                timeout=120)
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-policy-version"] == "2" and answer.json()["model"] == f"{name}@v2"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for card in httpx.get(f"{engine.url}/v1/models").json()["data"]:  # leave the session's engine as found
            if card.get("parent") and card["id"].split("@")[0] == name:
                httpx.post(f"{engine.url}/v1/unload_lora_adapter", json={"lora_name": card["id"]})
    run = tmp_path / "run"
    assert sorted(json.loads((run / "v2" / "trained.json").read_text())) == groups  # 2 steps of 2 groups, once each
    assert json.loads((run / "stream" / "feed_ack.json").read_text()) == {"seq": 2, "version": 2}
    weights = load_file(run / "v2" / "adapter_model.safetensors")
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in weights.items())  # B starts at 0: it trained
    records = policy_records(broker.bootstrap_servers, topics)
    assert [(r.name, r.version, Path(r.path)) for r in records] == [(name, 1, (run / "v1").resolve()),
                                                                     (name, 2, (run / "v2").resolve())]
