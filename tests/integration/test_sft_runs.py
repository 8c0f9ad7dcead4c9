"""`streamrl sft` on the tiny model: a fixed mapping ("say X" -> "X") lowers the held-out loss, the adapter
in OUT loads with peft, and a second run resumes from OUT's checkpoint at the saved step; ``--publish`` makes a
gateway in front of the real engine serve it, RL started from it publishes the next version, and an export of
the log trains with its token ids as logged (issue #42's tests)."""

from __future__ import annotations

import json
import random
import threading
import uuid
from dataclasses import replace

import httpx
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from support.kafka_reader import produce, wait_until
from support.records import call
from support.trainer_records import group, new_topics, policy_records
from transformers import AutoModelForCausalLM, AutoTokenizer

from streamrl.broker.embedded import free_port
from streamrl.broker.schema import WEIGHTS_FILE, RewardRecord, sha256_file
from streamrl.cli import main
from streamrl.gateway.config import GatewayConfig, GatewayKafka
from streamrl.gateway.server import GatewayServer
from streamrl.trainer.config import TrainerConfig
from streamrl.trainer.daemon import run_trainer
from streamrl.trainer.publish import META_FILE
from streamrl.trainer.sft import HISTORY_FILE
from streamrl.trainer.sft_data import load_sft_data

WORDS = ["apple", "river", "stone", "cloud", "green", "table", "music", "light", "paper", "winter", "orange",
         "silver", "garden", "rocket"]


def say_data(path):
    """One "say X" -> "X" chat per word."""
    path.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"say {w}"},
                                                       {"role": "assistant", "content": w}]}) for w in WORDS))
    return path


def publish_flags(bootstrap: str, topics, name: str) -> tuple[str, ...]:
    return "--publish", "--name", name, "--bootstrap-servers", bootstrap, "--topic-prefix", topics.prefix


def run(capsys, data, model, out, *flags: str) -> dict:
    code = main(["sft", str(data), "--model", str(model), "--out", str(out), "--step-tokens", "300",
                 "--eval-fraction", "0.2", "--eval-every", "5", "--save-every", "5", "--no-progress",
                 "--device", "cpu", *flags])
    assert code == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_sft_learns_writes_adapter_and_resumes(tmp_path, tiny_model, capsys) -> None:
    rng = random.Random(0)
    data = tmp_path / "say.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": w}]}
            for w in (rng.choice(WORDS) for _ in range(80))]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n")
    out = tmp_path / "adapter"

    first = run(capsys, data, tiny_model, out, "--max-steps", "10")
    assert first["steps"] == 10 and first["resumed_at"] == 0 and first["skipped"] == {"bad_json": 1}
    assert first["held_out"] == 16 and first["eval_loss"] < first["eval_loss_first"] - 0.3
    assert json.loads((out / META_FILE).read_text())["step"] == 10

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_model)), str(out))
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        tuned = model(ids).logits
        with model.disable_adapter():
            plain = model(ids).logits
    assert not torch.allclose(tuned, plain)  # the trained adapter, loaded by peft, changes the model

    second = run(capsys, data, tiny_model, out, "--max-steps", "15")
    assert second["resumed_at"] == 10 and second["steps"] == 15
    assert abs(second["eval_loss_first"] - first["eval_loss"]) < 1e-4  # the same weights it stopped with
    assert second["eval_loss"] < first["eval_loss"]
    steps = [json.loads(line)["step"] for line in (out / HISTORY_FILE).read_text().splitlines()
             if "loss" in json.loads(line)]
    assert steps == list(range(1, 16))  # steps 11..15 continue 1..10: nothing retrained, nothing skipped


def test_init_adapter_starts_from_the_sft_weights(tmp_path, tiny_model, capsys) -> None:
    """``--init-adapter`` (trainer and sft): the LoRA starts as the saved adapter computes, whatever
    ``lora_alpha`` (the saved scaling is folded into lora_B and rescaled on load)."""
    from streamrl.trainer.config import TrainerConfig
    from streamrl.trainer.model import load_policy

    data = tmp_path / "say.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"say {w}"},
                                                       {"role": "assistant", "content": w}]}) for w in WORDS))
    out = tmp_path / "adapter"
    run(capsys, data, tiny_model, out, "--max-steps", "3", "--eval-fraction", "0")
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(tiny_model)), str(out))
    ids = torch.tensor([[5, 6, 7, 8]])
    for alpha in (16.0, 32.0):
        model = load_policy(TrainerConfig.load(None, model=str(tiny_model), device="cpu", lora_alpha=alpha,
                                          init_adapter=str(out)), torch.device("cpu"))
        with torch.no_grad():
            assert torch.allclose(model(ids).logits, reference(ids).logits, atol=1e-5)


def test_publish_makes_the_adapter_the_next_version(broker, tmp_path, tiny_model, capsys) -> None:
    """``--publish``: the adapter in OUT, one past the newest version on the policy topic."""
    import uuid

    from streamrl.broker.policy_log import PolicyLog, adapter_record
    from streamrl.broker.topics import Topics, create_topics

    topics = Topics(f"sft-{uuid.uuid4().hex[:6]}")
    create_topics(broker.bootstrap_servers, topics)
    out = tmp_path / "adapter"
    data = tmp_path / "say.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": f"say {w}"},
                                                       {"role": "assistant", "content": w}]}) for w in WORDS))
    log = PolicyLog(broker.bootstrap_servers, topics)
    try:
        log.publish(adapter_record("student", 3, _fake_adapter(tmp_path / "old", WEIGHTS_FILE), str(tiny_model)))
    finally:
        log.close()
    summary = run(capsys, data, tiny_model, out, "--max-steps", "2", "--publish", "--name", "student",
                  "--bootstrap-servers", broker.bootstrap_servers, "--topic-prefix", topics.prefix)
    assert summary["published"]["version"] == 4
    assert summary["published"]["sha256"] == sha256_file(out / WEIGHTS_FILE)
    assert summary["published"]["path"] == str(out.resolve())


def _fake_adapter(root, weights_file: str):
    root.mkdir(parents=True)
    (root / weights_file).write_bytes(b"an older version")
    return root


def test_publish_makes_the_gateway_serve_the_version(broker, engine, tmp_path, tiny_model, capsys) -> None:
    """A gateway following ``--name``'s policy, in front of the real engine: it loads and routes the published
    SFT adapter, and a chat completion for the policy is answered by that version."""
    topics = new_topics(broker.bootstrap_servers)
    name = f"sftgw{uuid.uuid4().hex[:6]}"
    config = GatewayConfig(upstreams=(engine.url,),
                           kafka=GatewayKafka(bootstrap_servers=broker.bootstrap_servers, topic_prefix=topics.prefix),
                           port=free_port(), policy_name=name, health_interval_s=0.5)
    assert config.follow_policy
    out = tmp_path / "adapter"
    try:
        with GatewayServer(config) as gw:
            assert httpx.get(f"{gw.url}/health").json()["policy"]["version"] == 0
            summary = run(capsys, say_data(tmp_path / "say.jsonl"), tiny_model, out, "--max-steps", "2",
                          "--eval-fraction", "0", *publish_flags(broker.bootstrap_servers, topics, name))
            version = summary["published"]["version"]
            assert version == 1
            # the engine takes the adapter's rank (vLLM refuses a LoRA over --max-lora-rank)
            assert json.loads((out / "adapter_config.json").read_text())["r"] <= engine.config.max_lora_rank
            wait_until(lambda: httpx.get(f"{gw.url}/health").json()["policy"]["version"] == version,
                       f"the gateway routes v{version}", 60)
            r = httpx.post(f"{gw.url}/v1/chat/completions", timeout=120,
                           json={"model": name, "messages": [{"role": "user", "content": "say green"}],
                                 "max_tokens": 4})
            assert r.status_code == 200, r.text
            assert r.headers["x-policy-version"] == str(version)
            assert r.json()["model"] == f"{name}@v{version}"  # the engine answered with the SFT adapter
    finally:  # leave the shared engine without this test's adapter
        httpx.post(f"{engine.url}/v1/unload_lora_adapter", json={"lora_name": f"{name}@v1"})


def test_rl_from_the_sft_adapter_publishes_the_next_version(broker, tmp_path, tiny_model, capsys) -> None:
    """``--init-adapter``: the trainer's first version is numbered after the SFT's on the policy topic, and
    is the SFT adapter moved by one optimizer step (not a LoRA trained from its zero start)."""
    topics = new_topics(broker.bootstrap_servers)
    sft_out = tmp_path / "sft"
    # a large SFT learning rate: its weights stand far from a fresh LoRA, a single RL step stays near them
    summary = run(capsys, say_data(tmp_path / "say.jsonl"), tiny_model, sft_out, "--max-steps", "2",
                  "--eval-fraction", "0", "--learning-rate", "0.05",
                  *publish_flags(broker.bootstrap_servers, topics, "policy"))
    n = summary["published"]["version"]
    produce(broker.bootstrap_servers, topics, group("g0", version=n))  # sampled from the SFT version
    config = TrainerConfig.load(None, model=str(tiny_model), bootstrap_servers=broker.bootstrap_servers, device="cpu",
                           adapters=str(tmp_path / "rl"), topic_prefix=topics.prefix, init_adapter=str(sft_out),
                           groups_per_step=1, max_step_tokens=0, max_steps=1, metrics_port=free_port())
    stop = threading.Event()
    thread = threading.Thread(target=run_trainer, args=(config, stop), daemon=True)
    thread.start()
    try:
        wait_until(lambda: not thread.is_alive(), "the trainer's one step", 120)
    finally:
        stop.set()
        thread.join(60)
    records = policy_records(broker.bootstrap_servers, topics)
    assert [(r.name, r.version) for r in records] == [("policy", n), ("policy", n + 1)]
    rl = records[-1]
    assert rl.step == 1 and rl.path == str((config.policy_dir / f"v{n + 1}").resolve())
    assert rl.sha256 == sha256_file(config.policy_dir / f"v{n + 1}" / WEIGHTS_FILE) != records[0].sha256
    sft, trained = load_file(sft_out / WEIGHTS_FILE), load_file(config.policy_dir / f"v{n + 1}" / WEIGHTS_FILE)
    assert sft.keys() == trained.keys()
    moved = max((trained[k].float() - sft[k].float()).abs().max().item() for k in sft)
    largest = max(sft[k].float().abs().max().item() for k in sft if "lora_B" in k)
    # Adam's first update moves a weight by at most about the learning rate (x the scaling folded into B)
    scaling = config.lora.alpha / config.lora.rank
    assert 0 < moved <= 1.5 * scaling * config.optim.learning_rate < largest / 4


def test_rl_from_an_unpublished_adapter_publishes_it_first(broker, tmp_path, tiny_model, capsys) -> None:
    """``--init-adapter`` naming an adapter the fleet does not serve (an SFT run without ``--publish``): the
    trainer publishes it as v1 before its first step, so the groups it trains on are sampled from the weights
    it starts from; its first trained version is v2. A restart from the checkpoint publishes nothing again."""
    topics = new_topics(broker.bootstrap_servers)
    sft_out = tmp_path / "sft"
    run(capsys, say_data(tmp_path / "say.jsonl"), tiny_model, sft_out, "--max-steps", "2", "--eval-fraction", "0",
        "--learning-rate", "0.05")
    config = TrainerConfig.load(None, model=str(tiny_model), bootstrap_servers=broker.bootstrap_servers, device="cpu",
                           adapters=str(tmp_path / "rl"), topic_prefix=topics.prefix, init_adapter=str(sft_out),
                           groups_per_step=1, max_step_tokens=0, max_steps=1, metrics_port=free_port())
    produce(broker.bootstrap_servers, topics, group("g0", version=1))  # sampled from the initial adapter

    def train_until_stopped() -> None:
        stop = threading.Event()
        thread = threading.Thread(target=run_trainer, args=(replace(config, metrics_port=free_port()), stop),
                                  daemon=True)
        thread.start()
        try:
            wait_until(lambda: not thread.is_alive(), "the trainer's run", 120)
        finally:
            stop.set()
            thread.join(60)

    train_until_stopped()
    records = policy_records(broker.bootstrap_servers, topics)
    assert [(r.name, r.version, r.step) for r in records] == [("policy", 1, 0), ("policy", 2, 1)]
    assert records[0].metrics == {"init_adapter": 1.0}
    sft, served = load_file(sft_out / WEIGHTS_FILE), load_file(config.policy_dir / "v1" / WEIGHTS_FILE)
    assert sft.keys() == served.keys()
    assert all(torch.allclose(served[k].float(), sft[k].float(), atol=1e-6) for k in sft)
    assert any(sft[k].abs().max() > 0 for k in sft if "lora_B" in k)  # not a fresh LoRA's zero B
    train_until_stopped()  # max_steps reached at once: resumes from the checkpoint, publishes nothing
    assert [(r.name, r.version) for r in policy_records(broker.bootstrap_servers, topics)] == [
        ("policy", 1), ("policy", 2)]


def test_export_round_trip_trains_on_the_logged_token_ids(broker, tmp_path, tiny_model, capsys) -> None:
    """Records through ``streamrl export`` (Parquet and JSONL), then ``streamrl sft`` on the file: the
    sequences are the logged prompt and completion ids (a two-call trajectory merged into one), masked on
    the completions, and the step trains on exactly those tokens."""
    topics = new_topics(broker.bootstrap_servers)
    rng = np.random.default_rng(7)
    ids = lambda n: rng.integers(10, 2000, n).tolist()  # noqa: E731
    p1, c1, tool, c2, p3, c3 = ids(9), ids(5), ids(3), ids(4), ids(7), ids(6)
    records = [call("a", p1, c1, gid="ga"), call("a", p1 + c1 + tool, c2, gid="ga"), call("b", p3, c3, gid="gb"),
               RewardRecord("a", 1.0, group_id="ga"), RewardRecord("b", 0.5, group_id="gb")]
    produce(broker.bootstrap_servers, topics, records)
    expected = sorted([(p1 + c1 + tool + c2, [0] * 9 + [1] * 5 + [0] * 3 + [1] * 4),
                       (p3 + c3, [0] * 7 + [1] * 6)])
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model))
    for name in ("log.parquet", "log.jsonl"):
        assert main(["export", str(tmp_path / name), "--bootstrap-servers", broker.bootstrap_servers,
                     "--topic-prefix", topics.prefix, "--no-progress"]) == 0
        assert json.loads(capsys.readouterr().out)["rows"] == 2
        data = load_sft_data(tmp_path / name, tokenizer)
        assert data.rows == 2 and not data.skipped
        assert sorted((s.token_ids.tolist(), s.loss_mask.tolist()) for s in data.sequences) == expected
    exported = {r["trajectory_id"]: r["calls"] for r in pq.read_table(tmp_path / "log.parquet").to_pylist()}
    assert [c["completion_token_ids"] for c in exported["a"]] == [c1, c2]

    out = tmp_path / "adapter"
    summary = run(capsys, tmp_path / "log.parquet", tiny_model, out, "--max-steps", "1", "--eval-fraction", "0")
    assert summary["steps"] == 1 and summary["sequences"] == 2 and np.isfinite(summary["loss"])
    step = json.loads((out / HISTORY_FILE).read_text().splitlines()[-1])
    assert step["tokens"] == len(expected[0][0]) + len(expected[1][0])  # both sequences, in one step
    assert step["target_tokens"] == 5 + 4 + 6


def test_sft_steps_and_evaluations_reach_tensorboard(tmp_path, tiny_model, capsys) -> None:
    """``streamrl sft --report-to tensorboard``: each step's loss and each held-out evaluation are logged at
    their step, the same numbers as the history file's."""
    pytest.importorskip("tensorboard", reason="needs the tracking extra (the dev extra has it)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, tracking = tmp_path / "adapter", tmp_path / "tracking"
    run(capsys, say_data(tmp_path / "say.jsonl"), tiny_model, out, "--max-steps", "3", "--report-to", "tensorboard",
        "--tracking-dir", str(tracking), "--run-name", "sft-tracked")
    history = [json.loads(x) for x in (out / HISTORY_FILE).read_text().splitlines()]
    steps = [h for h in history if "loss" in h]
    evals = [h for h in history if "eval_loss" in h]
    assert [h["step"] for h in steps] == [1, 2, 3] and [h["step"] for h in evals] == [0, 3]
    [events] = list((tracking / "tensorboard").rglob("events.out.tfevents.*"))
    acc = EventAccumulator(str(events.parent))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [
        (h["step"], pytest.approx(h["loss"])) for h in steps]
    assert [(e.step, e.value) for e in acc.Scalars("eval_loss")] == [
        (h["step"], pytest.approx(h["eval_loss"])) for h in evals]
    assert {"eval_accuracy", "grad_norm", "tokens"} <= set(acc.Tags()["scalars"])
