"""The agents of examples/ through a real gateway (embedded broker, vLLM on the tiny model, each framework
unmodified): a few episodes each, their records token-exact and merged into training sequences as the
trainer merges them, a trainer step on them, and each framework's own success path (tool results returned
to the model, MCP tools discovered over stdio, LangGraph's state carried from turn to turn).

The tiny model is random: it calls no tool by itself. The tool examples force their first call with a named
``tool_choice`` (vLLM's guided decoding; the tools are ``strict`` so their arguments are constrained too), and
the tic-tac-toe agent samples only legal cells. Guided JSON still lets the model spin in whitespace until
``max_tokens``; the sampling seeds below are ones that give a well-formed call on the tiny model."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from support.kafka_reader import TopicReader
from transformers import AutoTokenizer

from streamrl.broker.embedded import EmbeddedBroker, free_port
from streamrl.broker.schema import CompletionRecord, JudgeRequest, RewardRecord
from streamrl.broker.security import KafkaSettings
from streamrl.broker.topics import Topics, create_topics
from streamrl.engine.server import Engine
from streamrl.gateway.config import GatewayConfig, GatewayKafka
from streamrl.gateway.server import GatewayServer
from streamrl.judge.config import JudgeConfig
from streamrl.judge.service import JudgeService
from streamrl.producers.client import AsyncGateway
from streamrl.producers.episode import Outcome
from streamrl.trainer.assembler import ReadyGroup, Trajectory, merge_calls
from streamrl.trainer.batch import Batch, build_batch
from streamrl.trainer.config import TrainerConfig
from streamrl.trainer.learner import Learner
from streamrl.trainer.metrics import batch_metrics
from streamrl.trainer.model import load_policy

TOPICS = Topics("examples")


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


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def tokenize(engine: Engine, base_model: str) -> Any:
    """The engine's own rendering and tokenization of a chat request (vLLM's ``POST /tokenize``)."""
    def run(body: dict[str, Any]) -> list[int]:
        r = httpx.post(f"{engine.url}/tokenize", json={**body, "model": base_model}, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]
    return run


@pytest.fixture(scope="module")
def learner(tiny_model: Path) -> Learner:
    torch.manual_seed(0)
    config = TrainerConfig.load(None, model=str(tiny_model), device="cpu", learning_rate=1e-2)
    return Learner(load_policy(config, torch.device("cpu")), config, torch.device("cpu"))


def play(url: str, task: Any, problems: list[Any], group_size: int | None = None) -> list[Outcome]:
    """One group: ``task``'s episodes of ``problems`` (one each) through the gateway, concurrently."""
    group = f"g-{uuid.uuid4().hex[:12]}"

    async def run() -> list[Outcome]:
        async with AsyncGateway(url) as gw:
            return await asyncio.gather(*(task.episode(gw, p, group, group_size or len(problems)) for p in problems))

    return asyncio.run(run())


def calls_of(completions: TopicReader, outcome: Outcome) -> list[CompletionRecord]:
    """A trajectory's completion records, by prompt length (the order merge_calls takes them in)."""
    calls = completions.wait_for(lambda r: isinstance(r, CompletionRecord) and r.trajectory_id == outcome.trajectory_id,
                                 count=outcome.turns)
    assert len(calls) == outcome.turns
    return sorted(calls, key=lambda r: len(r.prompt_token_ids))


def assert_token_exact(call: CompletionRecord, tokenize: Any) -> None:
    """The recorded prompt is what vLLM makes of the recorded request (its own chat template rendering, asked
    of its ``/tokenize``), token for token, and the completion has one sampling logprob per token."""
    request = call.request
    body = {"model": request["model"], "messages": request["messages"], "add_generation_prompt": True}
    if request.get("tools"):
        body["tools"] = request["tools"]
    assert call.prompt_token_ids.tolist() == tokenize(body)
    assert len(call.completion_token_ids) == len(call.logprobs) > 0
    assert np.isfinite(call.logprobs).all() and (call.logprobs <= 0).all()


def merged(calls: list[CompletionRecord]) -> int:
    """How many training sequences the trainer makes of a trajectory's calls (1: merged into one), checked:
    every sampled token is trained exactly once, none of the prompt tokens."""
    sequences = merge_calls(calls)
    assert sum(int(s.loss_mask.sum()) for s in sequences) == sum(len(c.completion_token_ids) for c in calls)
    return len(sequences)


def train_on(rewards: TopicReader, group: dict[str, list[CompletionRecord]],
             learner: Learner) -> None:
    """A trainer step on the group as the trainer would batch it (rewards from the log, GRPO advantages)."""
    got = {r.trajectory_id: r for r in rewards.wait_for(
        lambda r: isinstance(r, RewardRecord) and r.trajectory_id in group, count=len(group))}
    ready = ReadyGroup(next(iter(got.values())).group_id or "",
                       [Trajectory(tid, 0.0, completions=calls, reward=got[tid]) for tid, calls in group.items()], True)
    counts: Counter[str] = Counter()
    batch = build_batch(ready, current_version=0, max_lag=4, std_norm=True, counts=counts)
    assert batch is not None, f"the group carries no signal: {dict(counts)}"
    stats = learner.step(batch)
    assert stats.sequences == batch.num_rows and stats.grad_norm > 0
    # the step's merging counts (history, /metrics) say what merge_calls made of each trajectory
    multi = [calls for calls in group.values() if len(calls) > 1]
    m = batch_metrics(Batch.of(batch), 0)
    assert (m["trajectories_multi_call"], m["trajectories_split"]) == (len(multi),
                                                                      sum(merged(calls) > 1 for calls in multi))


# -------------------------------------------------------------------------------------------- tic-tac-toe


def test_tictactoe_games_through_the_gateway(gateway: GatewayServer, completions: TopicReader, rewards: TopicReader,
                                               tokenizer: Any, tokenize: Any, learner: Learner) -> None:
    from examples.tictactoe.agent import Game, TicTacToeTask
    from examples.tictactoe.game import REWARDS

    task = TicTacToeTask(legal_moves_only=True, strength=0.0)
    outcomes = play(gateway.url, task, [Game(seed, agent_first=True) for seed in (3, 4)])
    assert all(o.reward in REWARDS.values() and o.version == 0 and o.turns >= 3 for o in outcomes)
    group = {}
    for o in outcomes:
        calls = calls_of(completions, o)
        for call in calls:
            assert_token_exact(call, tokenize)
        assert tokenizer.decode(calls[0].completion_token_ids, skip_special_tokens=True) in {
            f"{c}{r}" for c in "abc" for r in "123"}
        # one sequence per game: each move's prompt starts with the previous prompt and move, so the moves
        # merge and every sampled token is trained once, in the context it was sampled in
        assert merged(calls) == 1
        group[o.trajectory_id] = calls
    if len({o.reward for o in outcomes}) > 1:
        train_on(rewards, group, learner)


# ------------------------------------------------------------------------------------ OpenAI Agents SDK


def test_agents_sdk_tool_loop(gateway: GatewayServer, completions: TopicReader, rewards: TopicReader,
                              tokenize: Any, learner: Learner) -> None:
    from examples.agents_sdk.agent import ShopAgentTask
    from examples.shop import PRICES, price_answer, sample_order

    order = sample_order(random.Random(0))
    outcomes = play(gateway.url, ShopAgentTask(first_tool="price_of", max_tokens=96, seed=0), [order])
    outcomes += play(gateway.url, ShopAgentTask(max_tokens=16, seed=1), [order])  # no tool: scores 0
    (forced, free) = outcomes
    assert forced.turns == 2 and free.turns == 1 and free.reward == 0.0
    calls = calls_of(completions, forced)
    for call in calls:
        assert_token_exact(call, tokenize)
    first, second = calls
    assert first.tool_calls and first.tool_calls[0]["function"]["name"] == "price_of"
    assert first.request["tool_choice"] == {"type": "function", "function": {"name": "price_of"}}
    assert second.request.get("tool_choice") in (None, "auto")  # reset by the SDK after the tool ran
    tool_message = second.request["messages"][-1]
    assert tool_message["role"] == "tool" and tool_message["content"] in {f"one {i} costs {p} cents"
                                                                           for i, p in PRICES.items()}
    assert forced.reward == (0.3 if tool_message["content"] == price_answer(order.item) else 0.1)  # examples/shop.py
    # two sequences: the template renders the call again, not as sampled (vLLM's Jinja ``tojson`` sorts its keys:
    # {"arguments": ..., "name": ...}), so the second prompt does not start with the first call's tokens
    assert merged(calls) == 2
    # the ladder (tool_steps): each call made to use the next tool, the last tool's answer the episode's answer
    (steps,) = play(gateway.url, ShopAgentTask(tool_steps=["price_of", "multiply"], max_tokens=96, seed=2), [order])
    ladder = calls_of(completions, steps)
    assert steps.turns == 2 and len(ladder) == 2
    for call, tool in zip(ladder, ("price_of", "multiply"), strict=True):
        assert_token_exact(call, tokenize)
        assert call.request["tool_choice"] == {"type": "function", "function": {"name": tool}}
    assert ladder[0].tool_calls and ladder[0].tool_calls[0]["function"]["name"] == "price_of"
    looked_up = ladder[1].request["messages"][-1]
    assert looked_up["role"] == "tool"
    price_rung = 0.3 if looked_up["content"] == price_answer(order.item) else 0.1
    if ladder[1].tool_calls:  # multiply ran: its answer is the episode's
        args = json.loads(ladder[1].tool_calls[0]["function"]["arguments"])
        assert ladder[1].tool_calls[0]["function"]["name"] == "multiply"
        assert steps.reward == (1.0 if args["a"] * args["b"] == order.total() else price_rung), (args, steps.reward)
    else:  # the tiny model's digits ran past max_tokens inside the arguments: no call, the lookup's rung
        assert ladder[1].finish_reason == "length" and steps.reward == price_rung
    train_on(rewards, {forced.trajectory_id: calls, free.trajectory_id: calls_of(completions, free),
                       steps.trajectory_id: ladder}, learner)


# ------------------------------------------------------------------------------------------- LangGraph


def test_langgraph_react_loop_carries_its_state(gateway: GatewayServer, completions: TopicReader,
                                                tokenize: Any) -> None:
    from examples.langgraph_react.agent import ShopGraphTask
    from examples.shop import price_answer, sample_order

    order = sample_order(random.Random(0))
    (outcome,) = play(gateway.url, ShopGraphTask(first_tool="price_of", max_tokens=96, seed=0), [order])
    assert outcome.turns == 2 and outcome.version == 0
    first, second = calls_of(completions, outcome)
    for call in (first, second):
        assert_token_exact(call, tokenize)
    # the graph's state went from the model node through the tool node back to the model: the second call
    # holds the first call's messages, its tool call and the tool's answer
    assert second.request["messages"][:2] == first.request["messages"]
    assistant, tool = second.request["messages"][2:]
    assert assistant["tool_calls"][0]["id"] == tool["tool_call_id"] == first.tool_calls[0]["id"]
    assert tool["content"].startswith(f"one {order.item} costs") or tool["content"].startswith("one ")
    assert outcome.reward == (0.3 if tool["content"] == price_answer(order.item) else 0.1)  # examples/shop.py
    assert all(t["function"]["strict"] for t in first.request["tools"])
    assert merged([first, second]) == 2


# ------------------------------------------------------------------------------------------------- MCP


def test_mcp_tools_discovered_over_stdio(gateway: GatewayServer, completions: TopicReader, tokenize: Any,
                                         tmp_path: Path) -> None:
    from examples.mcp_tools.agent import McpShopTask
    from examples.shop import ITEMS, sample_order

    task = McpShopTask(first_tool="list_products", max_tokens=64, seed=0, database=tmp_path / "shop.sqlite")
    (outcome,) = play(gateway.url, task, [sample_order(random.Random(0))])
    assert outcome.turns == 2 and outcome.reward == 0.1
    first, second = calls_of(completions, outcome)
    assert_token_exact(first, tokenize)
    # the tools offered are the server's, found by list_tools over stdio
    assert {t["function"]["name"] for t in first.request["tools"]} == {"list_products", "price_of", "stock_of"}
    assert first.tool_calls[0]["function"]["name"] == "list_products"
    tool = second.request["messages"][-1]
    assert tool["role"] == "tool" and all(item in tool["content"] for item in ITEMS)  # the server read the database
    assert merged([first, second]) == 2  # the tool call rendered again, not as sampled (docs/loop.md)


# ---------------------------------------------------------------------------------------- email search


def test_email_search_reads_the_mailbox(gateway: GatewayServer, completions: TopicReader, rewards: TopicReader,
                                        tokenize: Any, tmp_path: Path) -> None:
    from examples.email_search.agent import EmailTask

    task = EmailTask(first_tool="search_inbox", max_tokens=64, seed=5, n_emails=300,
                     database=tmp_path / "mailbox.sqlite")
    (outcome,) = play(gateway.url, task, [task.sample(random.Random(0))])
    assert outcome.turns == 2 and outcome.reward in (0.0, 0.1)
    first, second = calls_of(completions, outcome)
    assert_token_exact(first, tokenize)
    assert first.tool_calls[0]["function"]["name"] == "search_inbox"
    tool = second.request["messages"][-1]
    assert tool["role"] == "tool" and (tool["content"].startswith("[") or tool["content"].startswith("no email"))
    assert merged([first, second]) == 2  # the tool call rendered again, not as sampled (docs/loop.md)
    (reward,) = rewards.wait_for(lambda r: isinstance(r, RewardRecord) and r.trajectory_id == outcome.trajectory_id)
    assert reward.reward == outcome.reward and reward.metrics == {"turns": 2.0}


# -------------------------------------------------------------------------------------- judged, no reward


def test_autotask_generates_inputs_and_is_judged(broker: EmbeddedBroker, base_model: str, gateway: GatewayServer,
                                                 completions: TopicReader, rewards: TopicReader) -> None:
    """Inputs written by a model through the gateway from the one-line description, answered, and scored by the
    real ``streamrl judge`` service (``JudgeService``) through the same gateway: one judged reward per
    trajectory, relative to its group, which is what the trainer then trains on (tests/integration/test_judge.py)."""
    from examples.autotask.agent import AutoTask

    task = AutoTask(description="Name a colour.", n_inputs=4, generation_max_tokens=48, max_tokens=8)
    outcomes = play(gateway.url, task, [0, 1])
    assert task._inputs and all(o.turns == 1 for o in outcomes)
    asked = rewards.wait_for(lambda r: isinstance(r, JudgeRequest)
                             and r.trajectory_id in {o.trajectory_id for o in outcomes}, count=2)
    assert {r.rubric for r in asked} == {task.rubric} and {r.group_size for r in asked} == {2}
    generation = completions.wait_for(lambda r: isinstance(r, CompletionRecord) and r.purpose == "judge"
                                      and "Name a colour." in r.request["messages"][0]["content"])
    assert generation[0].trajectory_id not in {o.trajectory_id for o in outcomes}
    for o in outcomes:
        (call,) = calls_of(completions, o)
        assert call.request["messages"][1]["content"] in task._inputs

    # short explanations: the random tiny model writes gibberish up to the bound (structured output keeps it JSON)
    config = JudgeConfig(base_url=f"{gateway.url}/v1", model=base_model,
                         kafka=KafkaSettings(bootstrap_servers=broker.bootstrap_servers, topic_prefix=TOPICS.prefix),
                         max_explanation_chars=24, max_tokens=256, quiet_period_s=30,
                         commit_interval_s=0.2, name="autotask")
    stop = threading.Event()
    runner = threading.Thread(target=JudgeService(config, stop).run, daemon=True)
    runner.start()
    try:
        tids = {o.trajectory_id for o in outcomes}
        judged = rewards.wait_for(lambda r: isinstance(r, RewardRecord) and r.judged_by == "autotask"
                                  and r.trajectory_id in tids, count=2, timeout=120)
    finally:
        stop.set()
        runner.join(30)
    assert {r.trajectory_id for r in judged} == tids and len(judged) == 2
    group = {r.group_id for r in asked}
    for r in judged:
        assert 0.0 <= r.metrics["judge_score"] <= 1.0 and r.reward == pytest.approx(r.metrics["judge_score"])
        assert {r.group_id} == group and r.group_size == 2 and r.metrics["judge_prompt_tokens"] > 0
    # the judge's own call went through the gateway, recorded as purpose judge (never trained on)
    completions.wait_for(lambda c: isinstance(c, CompletionRecord) and c.group_id == f"judge.{next(iter(group))}"
                         and c.purpose == "judge")
