"""Producers: the trajectory client helper against the real gateway (embedded broker, vLLM on the tiny model,
the official openai client); the reward functions on their own: ``tests/unit/test_producer_functions.py``."""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.kafka_reader import TopicReader

from streamrl.broker.embedded import EmbeddedBroker, free_port
from streamrl.broker.schema import CompletionRecord, RewardRecord
from streamrl.broker.topics import Topics, create_topics
from streamrl.engine.server import Engine
from streamrl.gateway.config import GatewayConfig, GatewayKafka
from streamrl.gateway.server import GatewayServer
from streamrl.producers.calculator import CalculatorTask
from streamrl.producers.client import AsyncGateway, Gateway, RewardError, Trajectory
from streamrl.producers.numbers import NumbersTask, digit_fraction
from streamrl.producers.runner import RunLimits, run_groups

TOPICS = Topics("producers")  # own topics on the session broker: other tests' consumers never see these


# ------------------------------------------------------------------------- through the gateway


@pytest.fixture(scope="module")
def gateway(broker: EmbeddedBroker, engine: Engine) -> Iterator[GatewayServer]:
    create_topics(broker.bootstrap_servers, TOPICS, partitions=2)
    config = GatewayConfig(upstreams=(engine.url,),
                           kafka=GatewayKafka(bootstrap_servers=broker.bootstrap_servers, topic_prefix=TOPICS.prefix),
                           port=free_port(), health_interval_s=0.5, follow_policy=False)
    with GatewayServer(config) as gw:
        yield gw


@pytest.fixture
def log_topics() -> Topics:
    return TOPICS


def test_trajectory_tags_every_call_and_posts_the_reward(gateway: GatewayServer, completions: TopicReader,
                                                        rewards: TopicReader) -> None:
    group = f"g-{uuid.uuid4().hex}"
    with Trajectory(gateway.url, group_id=group, group_size=2) as t:
        for turn in range(2):
            reply = t.client.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": f"Turn {turn}: numbers?"}], max_tokens=8)
            assert reply.choices[0].message is not None
        t.reward(0.75, turns=2)
    assert t.posted
    calls = completions.wait_for(lambda r: isinstance(r, CompletionRecord) and r.trajectory_id == t.trajectory_id,
                                 count=2)
    assert len(calls) == 2 and all(r.group_id == group for r in calls)
    (reward,) = rewards.wait_for(lambda r: isinstance(r, RewardRecord) and r.trajectory_id == t.trajectory_id)
    assert (reward.reward, reward.group_id, reward.group_size, reward.metrics) == (0.75, group, 2, {"turns": 2.0})


def test_trajectory_that_raises_posts_nothing(gateway: GatewayServer) -> None:
    with Gateway(gateway.url) as gw:
        with pytest.raises(RuntimeError), gw.trajectory(group_id="g") as t:
            t.reward(1.0)
            raise RuntimeError("environment crashed")
        assert not t.posted
        with gw.trajectory() as quiet:  # no reward set: nothing to post
            pass
        assert not quiet.posted


def test_gateway_refusal_raises_reward_error(gateway: GatewayServer) -> None:
    with Gateway(gateway.url) as gw, pytest.raises(RewardError, match=r"-> 4\d\d"):
        gw.post_rewards([{"trajectory_id": "t", "reward": 1.0, "group_size": 0}])


def test_numbers_episodes_through_the_gateway(gateway: GatewayServer, completions: TopicReader,
                                              rewards: TopicReader) -> None:
    """A whole group through the runner: every trajectory gets a completion record and a reward record
    whose value is the digit fraction of what was returned; the base model serves as version 0."""
    board = asyncio.run(run_groups(gateway.url, NumbersTask(max_tokens=12), group_size=4, concurrency=2,
                                   limits=RunLimits(until_version=0, stop_groups=3), emit=lambda _: None))
    assert board.failed == 0 and board.groups >= 3
    assert set(board.versions) == {0}
    n = board.versions[0].n
    assert n >= 12 and 0.0 < board.versions[0].mean < 1.0
    got = rewards.wait_for(lambda r: isinstance(r, RewardRecord) and r.group_size == 4, count=n)
    records = {r.trajectory_id: r for r in completions.wait_for(
        lambda r: isinstance(r, CompletionRecord) and r.trajectory_id in {g.trajectory_id for g in got}, count=n)}
    for reward in got:
        assert reward.reward == pytest.approx(digit_fraction(records[reward.trajectory_id].response_text))
        assert records[reward.trajectory_id].group_id == reward.group_id
    # reply lengths as the trainer will see them: each trajectory's sampled token ids
    assert sorted(board.reply_tokens) == sorted(len(r.completion_token_ids) for r in records.values())


def test_calculator_agent_runs_the_tool_loop(gateway: GatewayServer, completions: TopicReader,
                                             rewards: TopicReader) -> None:
    """The tiny model cannot solve arithmetic; what is tested is the loop: a forced calculator call, its
    tool result sent back on the next turn of the same trajectory, and a reward posted at the end.

    The forced call's arguments are whatever the random model samples, and about half run past
    max_tokens (then vLLM returns text, not a tool call). The episodes are seeded so the test is
    reproducible: with seeds 0..7 on the tiny model, seeds 2, 5 and 6 produce a well-formed call."""
    group = f"g-{uuid.uuid4().hex}"

    async def play() -> list[Any]:
        async with AsyncGateway(gateway.url) as gw:
            problem = CalculatorTask().sample(random.Random(0))
            return await asyncio.gather(*(
                CalculatorTask(max_tokens=128, force_tool_first=True, max_turns=3, seed=seed).episode(
                    gw, problem, group, 8) for seed in range(8)))

    outcomes = asyncio.run(play())
    assert all(o.version == 0 and o.reward in (0.0, 0.1, 1.0) for o in outcomes)
    got = {r.trajectory_id: r for r in rewards.wait_for(
        lambda r: isinstance(r, RewardRecord) and r.group_id == group, count=8)}
    assert set(got) == {o.trajectory_id for o in outcomes}
    for o in outcomes:
        assert got[o.trajectory_id].reward == o.reward and got[o.trajectory_id].metrics == {"turns": float(o.turns)}
    looped = [o for o in outcomes if o.turns >= 2]
    assert looped, "no seeded episode got a well-formed forced tool call"
    calls = completions.wait_for(lambda r: isinstance(r, CompletionRecord) and r.trajectory_id == looped[0].trajectory_id,
                                 count=looped[0].turns)
    first, second = sorted(calls, key=lambda r: r.created)[:2]
    assert first.tool_calls and first.tool_calls[0]["function"]["name"] == "calculator"
    assert [m["role"] for m in second.request["messages"]][-2:] == ["assistant", "tool"]


def test_demo_command(gateway: GatewayServer, tmp_path: Path) -> None:
    """`streamrl demo` end to end against the gateway: stops at its limit and writes the summary."""
    from streamrl.cli import main

    summary = tmp_path / "summary.json"
    code = main(["demo", "--gateway", gateway.url, "--group-size", "2", "--concurrency", "1",
                 "--until-version", "0", "--stop-groups", "2", "--groups-per-step", "1", "--summary", str(summary)])
    result = json.loads(summary.read_text())
    assert code == 0 and result["failed"] == 0 and result["groups"] >= 2
    assert result["versions"]["0"]["n"] >= 4 and result["config"]["task"] == "numbers"
    reply = result["reply_tokens"]
    assert reply["n"] == result["trajectories"] and reply["p50"] <= reply["p90"] <= reply["max"] <= 16
