"""streamrl judge against the real broker and the real vLLM CPU server (its parser, rendering and group
completion on their own: ``tests/unit/test_judge_rules.py``): a group posted with judge requests instead of
rewards gets one judged reward per trajectory and is trained on; judge calls and judge requests are never
trained on; killed with SIGKILL and restarted, the judge scores no trajectory twice and skips none."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from kafka import TopicPartition
from support.kafka_reader import produce
from support.records import completion
from support.services import LOG_DIR

from streamrl.broker.clients import make_consumer
from streamrl.broker.embedded import EmbeddedBroker, free_port
from streamrl.broker.schema import (
    JudgeRequest,
    RewardRecord,
    decode,
)
from streamrl.broker.security import KafkaSettings
from streamrl.broker.topics import Topics, create_topics
from streamrl.engine.server import Engine
from streamrl.gateway.config import GatewayConfig, GatewayKafka
from streamrl.gateway.server import GatewayServer
from streamrl.judge.client import JudgeClient, JudgeFailed
from streamrl.judge.config import JudgeConfig
from streamrl.judge.prompt import answer_tokens, messages
from streamrl.judge.service import JudgeService
from streamrl.producers.client import Gateway
from streamrl.trainer.config import TrainerConfig
from streamrl.trainer.feed import StreamGroups
from streamrl.trainer.source import KafkaRecordSource

# ---- against the real broker and vLLM --------------------------------------------------------------------


def fresh_topics(broker: EmbeddedBroker, prefix: str) -> Topics:
    topics = Topics(prefix)
    create_topics(broker.bootstrap_servers, topics, partitions=2)
    return topics


def judge_config(broker: EmbeddedBroker, topics: Topics, base_url: str, model: str, **kw) -> JudgeConfig:
    """Short explanations: the random tiny model writes gibberish up to the bound (structured output keeps it JSON)."""
    return JudgeConfig(base_url=base_url, model=model,
                       kafka=KafkaSettings(bootstrap_servers=broker.bootstrap_servers, topic_prefix=topics.prefix),
                       max_explanation_chars=24, max_tokens=256, quiet_period_s=30, commit_interval_s=0.2, **kw)


def read_all(broker: EmbeddedBroker, topic: str) -> list:
    """Every record of ``topic``, from its beginning up to its end now (read until a poll brings nothing more)."""
    consumer = make_consumer(broker.bootstrap_servers, group_id=None)
    tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic) or ())]
    consumer.assign(tps)
    consumer.seek_to_beginning(*tps)
    end = consumer.end_offsets(tps)
    out = []
    while True:
        batch = consumer.poll(timeout_ms=500)
        out += [decode(m.value) for records in batch.values() for m in records]
        if not batch and all(consumer.position(tp) >= end[tp] for tp in tps):
            break
    consumer.close()
    return out


def wait_until(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.2)
    raise AssertionError(f"{what} not within {timeout}s")


def test_the_client_retries_malformed_answers_then_fails_clearly(engine: Engine, base_model: str) -> None:
    """Without structured output the random model's answers are never JSON: every attempt is refused."""
    config = JudgeConfig(base_url=f"{engine.url}/v1", model=base_model, structured_output="off", max_tokens=8,
                         max_attempts=2, retry_backoff_s=0.01)
    with pytest.raises(JudgeFailed, match=r"group g1: no usable judge answer in 2 attempts; last: "):
        JudgeClient(config, threading.Event()).judge("be right", ["user: hi\nassistant: yo"] * 2, "g1")


def test_a_structured_answer_of_the_random_model_parses(engine: Engine, base_model: str) -> None:
    config = JudgeConfig(base_url=f"{engine.url}/v1", model=base_model, max_explanation_chars=24, max_tokens=256)
    judged = JudgeClient(config, threading.Event()).judge("be right", ["user: hi\nassistant: yo"] * 3, "g2")
    assert len(judged.verdict.scores) == 3 and all(0 <= s <= 10 for s in judged.verdict.scores)
    assert judged.prompt_tokens > 0 and judged.completion_tokens > 0


def padded_group(engine: Engine, model: str, rubric: str, room: int) -> list[str]:
    """Two trajectories padded until the judge prompt leaves ``room`` tokens of the engine's context (counted
    by the engine's own ``/tokenize``); a negative ``room`` overflows it."""
    def left(words: int) -> int:
        rendered = [f"user: what is 2+2?\nassistant: {'four ' * words}"] * 2
        body = {"model": model, "messages": messages(rubric, rendered, 10), "add_generation_prompt": True}
        reply = httpx.post(f"{engine.url}/tokenize", json=body, timeout=30).json()
        return reply["max_model_len"] - reply["count"]

    lo, hi = 0, 2048  # words: left(lo) > room >= left(hi); the room shrinks as words grow
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if left(mid) > room else (lo, mid)
    assert left(hi) <= room < left(hi) + 4, (left(hi), room)  # "four" is one token or two: close enough
    return [f"user: what is 2+2?\nassistant: {'four ' * hi}"] * 2


def test_a_group_leaving_less_room_than_the_longest_answer_is_judged(engine: Engine, base_model: str) -> None:
    """The H200 judge-only run failed every group of 16: its prompt left 797 tokens of the context and the
    judge asked for the 798 the longest admissible answer could take, which vLLM 0.26 refuses (0.32, here,
    clamps). The judge asks for none now: the answer gets what the prompt leaves, and the regex ends it."""
    config = JudgeConfig(base_url=f"{engine.url}/v1", model=base_model, max_explanation_chars=24,
                         retry_backoff_s=0.01)
    longest = answer_tokens(2, 10, 24)
    rendered = padded_group(engine, base_model, config.rubric, longest - 4)
    try:
        judged = JudgeClient(config, threading.Event()).judge(config.rubric, rendered, "g-tight")
    except JudgeFailed as exc:  # the random model's gibberish may, rarely, outgrow the room: refused, not 400
        assert "no usable judge answer" in str(exc), exc
    else:
        assert len(judged.verdict.scores) == 2 and judged.completion_tokens < longest


def test_a_group_over_the_judge_context_fails_clearly_at_once(engine: Engine, base_model: str) -> None:
    config = JudgeConfig(base_url=f"{engine.url}/v1", model=base_model, max_explanation_chars=24, max_attempts=3)
    rendered = padded_group(engine, base_model, config.rubric, -8)
    with pytest.raises(JudgeFailed, match=r"group g-over: the judge endpoint refused the request: .*context"):
        JudgeClient(config, threading.Event()).judge(config.rubric, rendered, "g-over")


@pytest.fixture
def judge_gateway(broker: EmbeddedBroker, engine: Engine) -> Iterator[tuple[GatewayServer, Topics]]:
    topics = fresh_topics(broker, "judge-e2e")
    config = GatewayConfig(upstreams=(engine.url,),
                           kafka=GatewayKafka(bootstrap_servers=broker.bootstrap_servers, topic_prefix=topics.prefix),
                           port=free_port(), health_interval_s=0.5, follow_policy=False)
    gw = GatewayServer(config).start()
    yield gw, topics
    gw.stop()


def test_a_group_posted_without_rewards_is_judged_and_trained(broker, engine, base_model, judge_gateway) -> None:
    gw, topics = judge_gateway
    gid, tids = "e2e-group", ["e2e-t0", "e2e-t1", "e2e-t2"]
    bad = httpx.post(f"{gw.url}/v1/rewards", json={"trajectory_id": "x", "judge": {"rubric": 5}})
    assert bad.status_code == 400 and "rubric" in bad.json()["error"]["message"]
    bad = httpx.post(f"{gw.url}/v1/rewards", json={"trajectory_id": "x", "judge": {}, "metrics": {}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "metrics"
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
    history = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "", "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "c1", "content": "5"}]
    # the agent's own rewards, mixed in with a small weight on the judge: the random tiny model's scores
    # may all be equal, and a group whose rewards are all equal has nothing to train on
    agent_rewards = dict(zip(tids, (0.0, 0.5, 1.0), strict=True))
    with Gateway(gw.url) as agent:
        for tid in tids:
            with agent.trajectory(group_id=gid, group_size=3, trajectory_id=tid) as t:
                t.client.chat.completions.create(model=base_model, messages=history, max_tokens=6)
                t.reward(agent_rewards[tid])
                t.judge("Is the final answer 5?", weight=0.05)
            assert t.posted
        with pytest.raises(ValueError, match="weight must be a number in"):
            agent.trajectory().judge(weight=1.5)

    stop = threading.Event()
    service = JudgeService(judge_config(broker, topics, f"{gw.url}/v1", base_model, name="e2e"), stop)
    runner = threading.Thread(target=service.run, daemon=True)
    runner.start()
    try:
        judged = wait_until(lambda: [r for r in read_all(broker, topics.rewards)
                                     if isinstance(r, RewardRecord) and r.judged_by == "e2e"] or None, 120,
                            "judged rewards")
    finally:
        stop.set()
        runner.join(30)
    assert sorted(r.trajectory_id for r in judged) == tids
    for r in judged:
        assert 0.0 <= r.metrics["judge_score"] <= 1.0 and r.metrics["agent_reward"] == agent_rewards[r.trajectory_id]
        assert r.reward == pytest.approx(0.05 * r.metrics["judge_score"] + 0.95 * agent_rewards[r.trajectory_id])
        assert (r.group_id, r.group_size) == (gid, 3) and r.metrics["judge_prompt_tokens"] > 0
    # the judge's own call went through the gateway, recorded as purpose judge
    completions = read_all(broker, topics.completions)
    judge_calls = [c for c in completions if c.group_id == f"judge.{gid}"]
    assert judge_calls and {c.purpose for c in judge_calls} == {"judge"}
    prompt = judge_calls[0].request["messages"][1]["content"]
    assert "Is the final answer 5?" in prompt and "[tool call add(" in prompt and "tool result: 5" in prompt

    # the trainer trains the judged group, and never the judge's calls or the judge requests
    config = TrainerConfig.load(None, model="unused", topic_prefix=topics.prefix, group_size=3, groups_per_step=1,
                           max_step_tokens=0)
    source = KafkaRecordSource(broker.bootstrap_servers, topics, "judge-e2e-trainer")
    feed = StreamGroups(source, config)
    try:
        batch = None
        deadline = time.monotonic() + 60
        while batch is None and time.monotonic() < deadline:
            batch = feed.next_batch(1, 0, 0.5)
        assert batch is not None, dict(feed.counts)
    finally:
        feed.close()
    rows = batch.to_pylist()
    assert {r["group_id"] for r in rows} == {gid}
    assert sorted(r["trajectory_id"] for r in rows) == tids
    assert {r["trajectory_id"]: r["reward"] for r in rows} == pytest.approx({r.trajectory_id: r.reward for r in judged})
    assert feed.counts["not_trained_judge"] == len(judge_calls)
    assert feed.counts["not_trained_judge_request"] == 3


def judge_process(broker: EmbeddedBroker, topics: Topics, engine: Engine, model: str, log: Path,
                  commit_interval_s: float) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "streamrl.cli", "judge", "--bootstrap-servers", broker.bootstrap_servers,
         "--topic-prefix", topics.prefix, "--base-url", f"{engine.url}/v1", "--model", model, "--name", "once",
         "--max-explanation-chars", "24", "--max-tokens", "256", "--concurrency", "1",
         "--commit-interval-s", str(commit_interval_s)],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})


class RewardWatch:
    """The judged rewards on a topic as they come (from its beginning), for acting the moment a count is reached."""

    def __init__(self, broker: EmbeddedBroker, topic: str, judge: str) -> None:
        self.consumer = make_consumer(broker.bootstrap_servers, group_id=None)
        tps = [TopicPartition(topic, p) for p in sorted(self.consumer.partitions_for_topic(topic) or ())]
        self.consumer.assign(tps)
        self.consumer.seek_to_beginning(*tps)
        self.judge, self.seen = judge, []

    def wait_for(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.seen) < count:
            assert time.monotonic() < deadline, f"{len(self.seen)} of {count} judged rewards within {timeout}s"
            for records in self.consumer.poll(timeout_ms=100).values():
                for m in records:
                    r = decode(m.value)
                    if isinstance(r, RewardRecord) and r.judged_by == self.judge:
                        self.seen.append(r)

    def close(self) -> None:
        self.consumer.close()


def test_kill_9_and_restart_judges_every_trajectory_exactly_once(broker, engine, base_model) -> None:
    topics = fresh_topics(broker, "judge-once")
    groups, size = 12, 3
    records: list = []
    for g in range(groups):
        for i in range(size):
            tid = f"once-{g}-{i}"
            records.append(completion(tid, [{"role": "user", "content": f"question {g}"}], answer=f"answer {i}",
                                      gid=f"once-g{g}"))
            records.append(JudgeRequest(tid, group_id=f"once-g{g}", group_size=size))
    produce(broker.bootstrap_servers, topics, records)
    want = {f"once-{g}-{i}" for g in range(groups) for i in range(size)}
    log = LOG_DIR / "judge-once.log"

    def judged() -> list[RewardRecord]:
        return [r for r in read_all(broker, topics.rewards) if isinstance(r, RewardRecord) and r.judged_by == "once"]

    # The first judge commits no offset after its start (commit interval of an hour): killed once it has
    # posted rewards, its restart must read every request again and find its own rewards for them.
    watch = RewardWatch(broker, topics.rewards, "once")
    first = judge_process(broker, topics, engine, base_model, LOG_DIR / "judge-once-1.log", 3600)
    try:
        watch.wait_for(4, 120)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(30)
    log = LOG_DIR / "judge-once-2.log"
    second = judge_process(broker, topics, engine, base_model, log, 0.2)
    try:
        watch.wait_for(len(want), 180)
        wait_until(lambda: "caught up" in log.read_text(), 60, "the restarted judge catching up")
    finally:
        watch.close()
        second.send_signal(signal.SIGTERM)
        assert second.wait(60) == 0
    counts = Counter(r.trajectory_id for r in judged())
    assert set(counts) == want and set(counts.values()) == {1}, counts
    assert "'own_rewards_seen'" in log.read_text()  # the restart met rewards of the first run
    for r in judged():
        assert 0.0 <= r.reward <= 1.0 and r.group_size == size and "agent_reward" not in r.metrics
