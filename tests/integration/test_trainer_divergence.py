"""The trainer noticing that it diverges: the tiny demo model at a learning rate far too high, on records
produced to the embedded broker as the gateway produces them. It warns (log, history, policy record,
/metrics) and, with ``stop_on_divergence``, stops before publishing the version it would have trained
while diverging."""

from __future__ import annotations

import json
import logging
import urllib.request
from pathlib import Path

import pytest
import torch
from kafka import KafkaConsumer, TopicPartition
from support.kafka_reader import produce
from support.trainer_records import one_partition_topics, policy_records

from streamrl.broker.embedded import EmbeddedBroker, free_port
from streamrl.broker.schema import CompletionRecord, RewardRecord
from streamrl.broker.topics import Topics
from streamrl.producers.demo_model import build_demo_model
from streamrl.trainer.config import TrainerConfig
from streamrl.trainer.daemon import run_trainer
from streamrl.trainer.divergence import EXIT_DIVERGED
from streamrl.trainer.state import load_state

STEPS = 4
"""One group per step, every sample from version 0: staleness 0, 1, 2, 3 (within the default max_lag)."""
LEARNING_RATE = 1.0
"""50x the tiny demo's 2e-2: the demo at this rate went from KL 4.6 to NaN weights (docs/trainer.md)."""


GROUP_SIZE = 4
TOKENS = 8
"""Completion tokens per trajectory."""


@pytest.fixture(scope="module")
def samples(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    """The demo model (peaked like a real model: the random tiny one's near-uniform output barely moves at any
    learning rate) and ``STEPS`` groups sampled from it, with the logprobs it sampled them at, as vLLM serving
    version 0 would have logged them: at staleness 0 the trainer's logprobs match (KL ~0)."""
    from transformers import AutoModelForCausalLM

    model_dir = build_demo_model(tmp_path_factory.mktemp("demo-model") / "model")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    records: list = []
    for gid in (f"g{i}" for i in range(STEPS)):
        prompt = torch.randint(10, 2000, (12,), generator=g)
        for i in range(GROUP_SIZE):
            ids, logprobs = prompt, []
            with torch.no_grad():
                for _ in range(TOKENS):
                    logp = torch.log_softmax(model(ids[None]).logits[0, -1].float(), -1)
                    token = torch.multinomial(logp.exp(), 1, generator=g)
                    logprobs.append(float(logp[token]))
                    ids = torch.cat([ids, token])
            tid = f"{gid}-t{i}"
            completion = ids[len(prompt):]
            records += [CompletionRecord(request_id=f"{tid}-r", trajectory_id=tid, group_id=gid,
                                         prompt_token_ids=prompt.tolist(), completion_token_ids=completion.tolist(),
                                         logprobs=logprobs, policy_version=0),
                        RewardRecord(tid, float((completion < 1000).float().mean()) + 0.01 * i, group_id=gid,
                                     group_size=GROUP_SIZE)]
    return model_dir, records



def train(samples: tuple[Path, list], broker: EmbeddedBroker, root: Path, **cfg) -> tuple[int, TrainerConfig, Topics]:
    """The daemon in-process on the sampled groups, one per step, until it returns."""
    model, records = samples
    topics = one_partition_topics(broker.bootstrap_servers)  # groups ready in the order produced
    produce(broker.bootstrap_servers, topics, records)
    config = TrainerConfig.load(None, model=str(model), bootstrap_servers=broker.bootstrap_servers,
                           adapters=str(root / "adapters"), topic_prefix=topics.prefix, groups_per_step=1,
                           max_step_tokens=0, learning_rate=LEARNING_RATE, max_steps=STEPS, device="cpu",
                           history=str(root / "history.jsonl"), **cfg)
    return run_trainer(config), config, topics


def test_a_diverging_trainer_warns(samples: tuple[Path, list], broker: EmbeddedBroker, tmp_path: Path,
                                   caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    with caplog.at_level(logging.WARNING, logger="streamrl.trainer"):
        code, config, topics = train(samples, broker, tmp_path, metrics_port=port)
    assert code == 0
    history = [json.loads(line) for line in Path(config.history).read_text().splitlines()]
    diverging = [h["version"] for h in history if h["diverging"]]
    assert diverging and history[0]["diverging"] == 0.0, "version 1 (staleness 0) cannot show it yet"
    first = next(h for h in history if h["diverging"])
    assert "learning_rate = 1 is too high" in first["divergence"]
    warnings = [r.getMessage() for r in caplog.records
                if r.name == "streamrl.trainer" and r.levelno == logging.WARNING and "DIVERGING" in r.getMessage()]
    assert len(warnings) == len(diverging) and f"v{first['version']} step {first['step']} DIVERGING" in warnings[0]
    assert f"this step: KL {first['kl_behaviour']:.3g} nats/token" in warnings[0]
    assert "thresholds on the mean of 2 steps: KL > 3.5, ratio < 0.5, clipped > 0.3" in warnings[0]
    records = policy_records(broker.bootstrap_servers, topics)
    assert [r.version for r in records] == list(range(1, STEPS + 1))  # warned, still published
    assert [r.version for r in records if r.metrics["diverging"] == 1.0] == diverging
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    assert f"streamrl_trainer_diverging_steps_total {float(len(diverging))}" in metrics
    assert f"streamrl_trainer_diverging {history[-1]['diverging']}" in metrics


def test_stop_on_divergence_stops_before_publishing(samples: tuple[Path, list], broker: EmbeddedBroker, tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="streamrl.trainer"):
        code, config, topics = train(samples, broker, tmp_path, stop_on_divergence=True)
    assert code == EXIT_DIVERGED
    history = [json.loads(line) for line in Path(config.history).read_text().splitlines()]
    good = len(history)  # the versions published before the diverging step, none of them diverging
    assert good < STEPS and not any(h["diverging"] for h in history)
    # nothing of the diverging step was written: no version directory, no policy record, no checkpoint
    assert sorted(p.name for p in config.policy_dir.iterdir() if not p.name.startswith(".state")) == \
        [f"v{v}" for v in range(1, good + 1)]
    assert [r.version for r in policy_records(broker.bootstrap_servers, topics)] == list(range(1, good + 1))
    state = load_state(config.state_path)
    assert state is not None and state.version == good
    # offsets not committed past the checkpoint: a restart retrains the diverging step's group
    consumer = KafkaConsumer(bootstrap_servers=broker.bootstrap_servers, group_id=config.group_id,
                             enable_auto_commit=False)
    try:
        for key, offset in state.offsets.items():
            topic, partition = key.rsplit(":", 1)
            committed = consumer.committed(TopicPartition(topic, int(partition)))
            assert committed in (None, offset), (key, committed, offset)
    finally:
        consumer.close()
    stopping = [r.getMessage() for r in caplog.records if r.name == "streamrl.trainer" and r.levelno == logging.ERROR]
    assert len(stopping) == 1 and f"stopping before publishing v{good + 1}" in stopping[0]
    assert "lower learning_rate (now 1)" in stopping[0] and f"continues from v{good}" in stopping[0]
