"""The trainer daemon end to end on the CPU: tiny model, real embedded broker, records produced as the
gateway produces them; adapters loaded back by peft and by the real vLLM test server; kill -9 and
restart without training any group twice or skipping one."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from kafka import KafkaConsumer, TopicPartition
from safetensors.torch import load_file
from support.kafka_reader import produce
from support.trainer_records import GROUP_SIZE, group_records, new_topics, policy_records

from streamrl.broker.embedded import free_port
from streamrl.broker.topics import Topics
from streamrl.trainer.config import TrainerConfig
from streamrl.trainer.daemon import cpu_threads, run_trainer
from streamrl.trainer.state import load_state


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def trained(tiny_model, broker, tmp_path_factory):
    """Run the daemon in-process on 4 groups (2 per step) until it has published two versions."""
    root = tmp_path_factory.mktemp("trainer")
    topics = new_topics(broker.bootstrap_servers)
    rng = np.random.default_rng(0)
    groups = [f"g{i}" for i in range(4)]
    produce(broker.bootstrap_servers, topics, [r for g in groups for r in group_records(g, rng)])
    config = TrainerConfig.load(None, model=str(tiny_model), bootstrap_servers=broker.bootstrap_servers,
                           adapters=str(root / "adapters"), topic_prefix=topics.prefix, groups_per_step=2,
                           max_step_tokens=0,  # two steps of two groups: the four are all ready at once
                           history=str(root / "history.jsonl"), save_batches=str(root / "batches"),
                           metrics_port=free_port(), device="cpu")
    stop = threading.Event()
    thread = threading.Thread(target=run_trainer, args=(config, stop), daemon=True)
    thread.start()
    try:
        wait_for(lambda: (config.policy_dir / "v2").exists() or not thread.is_alive(), 180, "version 2")
        wait_for(lambda: len(policy_records(broker.bootstrap_servers, topics)) >= 2, 30, "policy records")
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{config.metrics_port}/metrics").read().decode()
    finally:
        stop.set()
        thread.join(60)
    assert not thread.is_alive()
    return {"config": config, "topics": topics, "groups": groups, "metrics": metrics, "root": root}


def test_daemon_trains_publishes_and_reports(trained, broker) -> None:
    config, topics = trained["config"], trained["topics"]
    records = policy_records(broker.bootstrap_servers, topics)
    assert [r.version for r in records] == [1, 2]
    for r in records:
        path = Path(r.path)
        assert path == (config.policy_dir / f"v{r.version}").resolve()
        assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in path.iterdir()}
        assert r.sha256 == hashlib.sha256((path / "adapter_model.safetensors").read_bytes()).hexdigest()
        assert r.base_model == config.model and r.name == "policy" and r.step == r.version
        assert r.metrics["groups"] == 2 and r.metrics["sampled_tokens"] == 2 * GROUP_SIZE * 14
    history = [json.loads(line) for line in Path(config.history).read_text().splitlines()]
    assert [h["version"] for h in history] == [1, 2]
    trained_groups = [g for h in history for g in h["group_ids"]]
    assert sorted(trained_groups) == trained["groups"]  # each group exactly once
    for key in ("reward_mean", "reward_std", "tokens", "staleness_mean", "staleness_max", "loss", "ratio_mean",
                "truncated_frac", "grad_norm", "kl_behaviour", "tokens_per_s"):
        assert np.isfinite(history[-1][key]), key
    assert history[-1]["counts"]["groups_ready"] == 4
    for h, r in zip(history, records, strict=True):  # sampled tokens by staleness: all of them, and only there
        assert sum(h["staleness_tokens"].values()) == h["sampled_tokens"]
        assert max(int(k) for k in h["staleness_tokens"]) == h["staleness_max"]
        assert "staleness_tokens" not in r.metrics and "staleness_mean" in r.metrics
    for h in history:  # where each step's wall-clock went: every phase timed, the step itself not free
        assert all(h[k] >= 0 for k in ("wait_s", "adapter_s", "checkpoint_s", "announce_s")) and h["step_s"] > 0
        assert h["step_s"] >= h["seconds"]
    assert "streamrl_trainer_reward_mean" in trained["metrics"]
    assert 'streamrl_trainer_records_total{outcome="groups_ready"}' in trained["metrics"]
    # one saved batch per group, merged multi-turn: 4 sequences of 12 + 8 + 4 + 6 tokens per group
    batches = sorted((trained["root"] / "batches").glob("*.parquet"))
    assert len(batches) == 4


def test_adapter_loads_in_peft_with_trained_weights(trained) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    v2 = trained["config"].policy_dir / "v2"
    base = AutoModelForCausalLM.from_pretrained(trained["config"].model)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        before = base(input_ids=ids).logits
        model = PeftModel.from_pretrained(base, v2)
        after = model(input_ids=ids).logits
    saved = load_file(v2 / "adapter_model.safetensors")
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in saved.items())  # B starts at 0: it trained
    assert not torch.allclose(before, after)


def test_adapter_loads_in_vllm(trained, engine) -> None:
    name = f"trainer-test-{uuid.uuid4().hex[:6]}"
    path = str((trained["config"].policy_dir / "v2").resolve())
    with httpx.Client(base_url=engine.url, timeout=120) as client:
        r = client.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
        assert r.status_code == 200, r.text
        r = client.post("/v1/completions", json={"model": name, "prompt": "What is 2 + 2?", "max_tokens": 8})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == name and r.json()["choices"][0]["text"] is not None
        client.post("/v1/unload_lora_adapter", json={"lora_name": name})


def test_replay_trains_from_saved_batches(trained, tmp_path) -> None:
    config = TrainerConfig.load(None, model=trained["config"].model, adapters=str(tmp_path), replay=str(trained["root"] / "batches"),
                           groups_per_step=2, device="cpu", history=str(tmp_path / "h.jsonl"))
    assert run_trainer(config) == 0
    assert torch.get_num_threads() == cpu_threads(config) == max(1, len(os.sched_getaffinity(0)) // 2)
    history = [json.loads(line) for line in Path(config.history).read_text().splitlines()]
    assert sorted(g for h in history for g in h["group_ids"]) == trained["groups"]
    assert sorted(p.name for p in config.policy_dir.glob("v*")) == ["v1", "v2"]


def trainer_process(tiny_model: Path, bootstrap: str, topics: Topics, adapters: Path, log: Path) -> subprocess.Popen:
    # every sample here claims version 0 (no gateway): --max-lag 8 keeps all six groups fresh enough;
    # --max-ready-groups 1 with --backlog wait: reads pause while a group waits, so the restarts cross paused
    # reads too; --max-step-tokens 0: one group per step, six versions
    cmd = [sys.executable, "-m", "streamrl.cli", "trainer", "--model", str(tiny_model), "--bootstrap-servers",
           bootstrap, "--adapters", str(adapters), "--topic-prefix", topics.prefix, "--groups-per-step", "1",
           "--max-steps", "6", "--keep-versions", "100", "--device", "cpu", "--max-lag", "8",
           "--max-ready-groups", "1", "--backlog", "wait", "--max-step-tokens", "0", "--history", str(adapters / "history.jsonl")]
    return subprocess.Popen(cmd, stdout=open(log, "ab"), stderr=subprocess.STDOUT, start_new_session=True)


def test_a_sigterm_during_start_up_is_a_clean_stop(tiny_model, broker, tmp_path) -> None:
    """SIGTERM as soon as the trainer has printed its configuration (its handlers are in place by then;
    torch, the model and Kafka are still to come): it exits 0 and trains nothing, groups ready or not."""
    topics = new_topics(broker.bootstrap_servers)
    produce(broker.bootstrap_servers, topics, group_records("s0", np.random.default_rng(2)))
    adapters, log = tmp_path / "adapters", tmp_path / "trainer.log"
    proc = trainer_process(tiny_model, broker.bootstrap_servers, topics, adapters, log)
    try:
        wait_for(lambda: "effective configuration" in log.read_text() or proc.poll() is not None, 120,
                 "the configuration")
        os.killpg(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert not list((adapters / "policy").glob("v*")), "trained after the stop"


def test_kill_9_sigterm_and_restart_train_every_group_exactly_once(tiny_model, broker, tmp_path) -> None:
    topics = new_topics(broker.bootstrap_servers)
    rng = np.random.default_rng(1)
    groups = [f"k{i}" for i in range(6)]
    produce(broker.bootstrap_servers, topics, [r for g in groups[:4] for r in group_records(g, rng)])
    adapters, log = tmp_path / "adapters", tmp_path / "trainer.log"
    proc = trainer_process(tiny_model, broker.bootstrap_servers, topics, adapters, log)
    try:
        wait_for(lambda: (adapters / "policy" / "v2").exists() or proc.poll() is not None, 180, "version 2")
        os.killpg(proc.pid, signal.SIGKILL)  # mid-run: step 3 is being trained or about to be
        proc.wait()
        # a group half-written when the trainer died, and the rest
        half = group_records(groups[4], rng)
        produce(broker.bootstrap_servers, topics, half[: len(half) // 2])
        proc = trainer_process(tiny_model, broker.bootstrap_servers, topics, adapters, log)
        # the first trainer may have made v3 before the kill landed: wait for the second one to be running
        # (its SIGTERM handler is installed before it logs where it resumes), not only for v3
        wait_for(lambda: log.read_text().count("resuming at version") >= 2 or proc.poll() is not None, 180,
                 "the restarted trainer")
        wait_for(lambda: (adapters / "policy" / "v3").exists() or proc.poll() is not None, 180, "version 3")
        os.killpg(proc.pid, signal.SIGTERM)  # graceful stop: finishes what it is doing, exits 0
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
        proc = trainer_process(tiny_model, broker.bootstrap_servers, topics, adapters, log)
        produce(broker.bootstrap_servers, topics, half[len(half) // 2:] + group_records(groups[5], rng))
        assert proc.wait(timeout=240) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    policy = adapters / "policy"
    versions = sorted(int(p.name[1:]) for p in policy.glob("v*"))
    assert versions == [1, 2, 3, 4, 5, 6]
    trained_groups = [g for v in versions for g in json.loads((policy / f"v{v}" / "streamrl_trainer.json").read_text())["groups"]]
    assert sorted(trained_groups) == groups  # none twice, none skipped
    assert [r.version for r in policy_records(broker.bootstrap_servers, topics)] == versions
    state = load_state(policy / ".state")
    # offsets committed to Kafka under the trainer's group = the checkpoint's = every record produced
    # (tansu's ListOffsets under-reports the end of multi-record batches, so count instead)
    c = KafkaConsumer(bootstrap_servers=broker.bootstrap_servers, group_id="streamrl-trainer.policy",
                      enable_auto_commit=False)
    tps = [TopicPartition(t, p) for t in (topics.completions, topics.rewards) for p in (0, 1)]
    committed = {f"{tp.topic}:{tp.partition}": c.committed(tp) for tp in tps}
    c.close()
    assert state is not None and committed == state.offsets
    assert sum(v for k, v in committed.items() if "completions" in k) == 6 * GROUP_SIZE * 2
    assert sum(v for k, v in committed.items() if "rewards" in k) == 6 * GROUP_SIZE
    assert state.version == 6 and state.step == 6 and not state.pending
    assert all(int(s["step"]) == 6 for s in state.optimizer["state"].values())  # optimizer state carried over


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_adapter_is_written_in_the_base_models_dtype(dtype: torch.dtype, tmp_path: Path) -> None:
    """The published weights take the base model's dtype (vLLM casts a LoRA to its model's dtype anyway),
    under the same names peft's own ``save_pretrained`` writes, with the scaling folded into ``lora_B`` (so
    vLLM skips its multiply on load), and peft loads them back into the same model."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from streamrl.trainer.publish import write_adapter

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    lora = LoraConfig(r=4, lora_alpha=12, target_modules=["q_proj", "v_proj"])  # scaling 3: not a power of 2
    base = Qwen2ForCausalLM(config).to(dtype)
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    model = get_peft_model(base, lora)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p)  # trained: B is no longer 0
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "lora_" in n)  # peft's default
    path, sha = write_adapter(model, tmp_path / "policy", 1, {"step": 1})
    saved = load_file(path / "adapter_model.safetensors")
    model.save_pretrained(tmp_path / "peft-own")
    own = load_file(tmp_path / "peft-own" / "adapter_model.safetensors")
    assert saved.keys() == own.keys() and len(saved) == 8
    for key, value in saved.items():
        assert value.dtype == dtype
        expected = own[key] * (3.0 if "lora_B" in key else 1.0)
        torch.testing.assert_close(value, expected.to(dtype), rtol=0, atol=0)
    assert json.loads((path / "adapter_config.json").read_text())["lora_alpha"] == 4  # scaling 1 on disk
    assert sha == hashlib.sha256((path / "adapter_model.safetensors").read_bytes()).hexdigest()
    fresh = Qwen2ForCausalLM(config).to(dtype)
    fresh.load_state_dict(base_state)
    reloaded = PeftModel.from_pretrained(fresh, path)
    weights = {n: p for n, p in reloaded.named_parameters() if "lora_B" in n}
    assert weights and all(p.abs().sum() > 0 for p in weights.values())
    if dtype == torch.float32:  # the same model (bf16's rounding of B is checked weight by weight above)
        ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
        with torch.no_grad():
            torch.testing.assert_close(reloaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_vllm_serves_the_written_adapter_as_the_trainer_computes_it(tiny_model, engine, tmp_path) -> None:
    """What the trainer writes (its scaling folded into ``lora_B``, scaling 1 on disk) is what vLLM serves:
    the sampling logprobs of a completion under the adapter equal the trainer's recompute with its in-memory
    adapter at temperature 0.7, within the tolerance of vLLM's bf16 against the trainer's fp32 (twice what the
    base model shows in test_engine_capture.py: vLLM also runs the adapter in bf16; measured here 6-7e-3 at
    most, 2.0e-3 on average), and differ from the base model's and from the adapter's with its scaling applied twice or
    not at all by far more than that."""
    from streamrl.trainer.model import load_policy, packed_logprobs
    from streamrl.trainer.publish import write_adapter

    config = TrainerConfig.load(None, model=str(tiny_model), device="cpu", lora_rank=8, lora_alpha=24.0)  # scaling 3
    model = load_policy(config, torch.device("cpu"))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)  # trained: B is no longer 0
    path, _ = write_adapter(model, tmp_path / "policy", 1, {"step": 1})
    name = f"folded-{uuid.uuid4().hex[:6]}"
    prompt = [int(t) for t in np.random.default_rng(0).integers(10, 2000, 12)]
    with httpx.Client(base_url=engine.url, timeout=120) as http:
        r = http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path.resolve())})
        assert r.status_code == 200, r.text
        try:
            r = http.post("/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": 32, "seed": 3,
                                                   "temperature": 0.7, "logprobs": 0, "return_token_ids": True,
                                                   "ignore_eos": True})
            assert r.status_code == 200, r.text
        finally:
            http.post("/v1/unload_lora_adapter", json={"lora_name": name})
    choice = r.json()["choices"][0]
    sampled = choice["token_ids"]
    logged = torch.tensor(choice["logprobs"]["token_logprobs"], dtype=torch.float32)
    ids = torch.tensor([prompt + sampled])
    targets = torch.arange(len(prompt), ids.shape[1])
    temperatures = torch.full((len(sampled),), 0.7)
    with torch.no_grad():
        recomputed = packed_logprobs(model, ids, torch.arange(ids.shape[1])[None], targets, temperatures=temperatures)
        with model.disable_adapter():
            base = packed_logprobs(model, ids, torch.arange(ids.shape[1])[None], targets, temperatures=temperatures)
        misscaled = {}  # the adapter with its scaling applied twice, or not at all
        for factor in (3.0, 1 / 3):
            lora_bs = [p for param_name, p in model.named_parameters() if "lora_B" in param_name]
            for p in lora_bs:
                p.mul_(factor)
            misscaled[factor] = packed_logprobs(model, ids, torch.arange(ids.shape[1])[None], targets,
                                                temperatures=temperatures)
            for p in lora_bs:
                p.div_(factor)
    assert len(sampled) == len(logged) == 32
    diff = (logged - recomputed).abs()
    assert diff.max() < 2e-2 and diff.mean() < 4e-3, (diff.max(), diff.mean())
    assert (logged - base).abs().max() > 0.1  # the adapter is what served them
    for factor, wrong in misscaled.items():  # and its scaling once: bf16's error is far below a scaling's
        assert (logged - wrong).abs().mean() > 10 * diff.mean(), (factor, (logged - wrong).abs().mean(), diff.mean())
