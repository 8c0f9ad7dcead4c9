"""Producers without a server: the environments' reward functions and tools, the client's reward body and
version helpers, and the pacer."""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable

import pytest

from streamrl.producers.calculator import CalculatorTask, calculate, final_number, run_tool, score
from streamrl.producers.client import reward_body
from streamrl.producers.episode import Outcome, newest, served_version
from streamrl.producers.numbers import digit_fraction
from streamrl.producers.runner import (
    Board,
    Pacer,
    RunLimits,
    describe,
    reply_token_stats,
    run_groups,
    trainable,
)

# ------------------------------------------------------------------------------ reward functions


def test_digit_fraction() -> None:
    assert digit_fraction("123 456") == 1.0
    assert digit_fraction("ab12") == 0.5
    assert digit_fraction(" 7 apples") == pytest.approx(1 / 7)
    assert digit_fraction("") == 0.0
    assert digit_fraction(" \n\t") == 0.0
    assert digit_fraction("no digits here") == 0.0


def test_calculate_is_plain_arithmetic_only() -> None:
    assert calculate("(12 + 7) * 3") == 57
    assert calculate("-4 + 10 // 3") == -1
    assert calculate("7 / 2") == 3.5
    assert calculate("17 % 5") == 2
    for bad in ("__import__('os')", "2 ** 100000", "abs(-1)", "x + 1", "1 +", "True + 1", "'a' * 3", "1" * 201):
        with pytest.raises(ValueError):
            calculate(bad)
    with pytest.raises(ValueError, match="division by zero"):
        calculate("1 / 0")


def test_calculator_scoring() -> None:
    assert final_number("The answer is 1,234.") == 1234.0
    assert final_number("first 3 then -5") == -5.0
    assert final_number("nothing") is None
    assert score("57", 57.0, used_tool=False) == 1.0
    assert score("It is 56", 57.0, used_tool=True) == 0.1
    assert score("It is 56", 57.0, used_tool=False) == 0.0
    assert score("", 57.0, used_tool=True) == 0.1


def test_run_tool() -> None:
    assert run_tool("calculator", '{"expression": "6 * 7"}') == ("42", True)
    assert run_tool("calculator", '{"expression": "1 / 4"}') == ("0.25", True)
    for args in ("not json", "123", "{}", '{"expression": "import os"}'):
        text, ok = run_tool("calculator", args)
        assert not ok and text.startswith("error:"), args
    assert run_tool("search", "{}") == ("error: unknown tool 'search'", False)


def test_calculator_problems_have_right_answers() -> None:
    task = CalculatorTask()
    rng = random.Random(3)
    for _ in range(50):
        p = task.sample(rng)
        a, op, b = p.question.removeprefix("What is ").removesuffix("?").split()
        assert p.answer == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]


def test_reward_body_validates() -> None:
    assert reward_body("t1", 1) == {"trajectory_id": "t1", "reward": 1.0}
    assert reward_body("t1", 0.5, "g", 4, {"turns": 2.0}) == {
        "trajectory_id": "t1", "reward": 0.5, "group_id": "g", "group_size": 4, "metrics": {"turns": 2.0}}
    for bad in (math.nan, math.inf, -math.inf, True, "1", None):
        with pytest.raises(ValueError):
            reward_body("t1", bad)  # type: ignore[arg-type]


def test_one_reward_rule_for_the_sdk_and_the_log() -> None:
    """The SDK's bodies and decoded reward records are checked by the same function (``reward_record``)."""
    from streamrl.broker import schema

    for fields in ({"metrics": {"m": math.nan}}, {"metrics": {"m": True}}, {"group_size": 0}, {"group_id": ""}):
        with pytest.raises(schema.RecordError) as from_log:
            schema.decode(schema._pack(schema.KIND_REWARD, {"trajectory_id": "t", "reward": 1.0, **fields}))
        with pytest.raises(schema.RecordError) as from_sdk:
            reward_body("t", 1.0, fields.get("group_id"), fields.get("group_size"), fields.get("metrics"))
        assert from_log.value.reason == from_sdk.value.reason


def test_version_helpers_and_board() -> None:
    assert served_version({"X-Policy-Version": "3"}) == 3
    assert served_version({}) is None
    assert served_version({"X-Policy-Version": "v3"}) is None
    assert newest(None, 2) == 2 and newest(4, None) == 4 and newest(1, 3) == 3 and newest(None, None) is None
    from streamrl.producers.episode import Outcome

    board = Board()
    for r in (0.2, 0.4):
        board.add(Outcome(r, 0))
    assert board.closed_lines() == []  # v0 is still the newest: nothing closed
    board.add(Outcome(1.0, 1))
    lines = board.closed_lines()
    assert len(lines) == 1 and "v0" in lines[0] and "0.300" in lines[0]
    assert board.closed_lines() == []  # printed once
    summary = board.summary()
    assert summary["versions"]["0"]["n"] == 2 and summary["versions"]["0"]["mean"] == pytest.approx(0.3)
    assert summary["versions"]["1"]["mean"] == 1.0 and summary["trajectories"] == 3


def test_board_summary_has_exact_reply_lengths() -> None:
    """Every trajectory's sampled tokens, nearest rank: the longest reply is the max, not a step's mean."""
    from types import SimpleNamespace

    from streamrl.producers.episode import Outcome, completion_tokens

    assert completion_tokens(SimpleNamespace(usage=SimpleNamespace(completion_tokens=12))) == 12
    assert completion_tokens(SimpleNamespace(usage=None)) is None
    assert Board().summary()["reply_tokens"] is None  # no lengths: readers fall back to their estimate
    board = Board()
    for n in [*range(1, 11), None]:  # a trajectory whose responses had no usage is left out
        board.add(Outcome(0.5, 0, reply_tokens=n))
    board.add(Outcome(0.5, 1, reply_tokens=700))
    assert board.summary()["reply_tokens"] == {"p50": 6, "p90": 10, "max": 700, "n": 11}
    assert reply_token_stats([5]) == {"p50": 5, "p90": 5, "max": 5, "n": 1}


def test_an_error_is_described_with_the_cause_that_names_what_failed() -> None:
    """The OpenAI client over httpx-aiohttp says "Request timed out." for a refused connection: the innermost cause
    (its first line) says which; a cause that says nothing more is left out."""
    def raised(outer: Exception, cause: Exception | None) -> Exception:
        try:
            try:
                if cause is not None:
                    raise cause
            finally:
                raise outer from cause
        except Exception as exc:
            return exc

    refused = raised(TimeoutError("Request timed out."), ConnectionRefusedError("Connect call failed ('127.0.0.1', 1)"))
    assert describe(refused) == "TimeoutError: Request timed out. (Connect call failed ('127.0.0.1', 1))"
    assert describe(raised(ValueError("no route to host a"), OSError("host a"))) == "ValueError: no route to host a"
    assert describe(raised(LookupError("gone"), OSError("first line\nmore"))) == "LookupError: gone (first line)"
    assert describe(RuntimeError("alone")) == "RuntimeError: alone"


def test_trainable_groups() -> None:
    assert trainable([0.1, 0.5], 2)
    assert not trainable([0.5, 0.5], 2)   # no signal: the trainer skips it
    assert not trainable([0.1, 0.5], 3)   # a trajectory failed


def test_pacer_holds_generation_to_the_step_and_refunds_unusable_groups() -> None:
    """max_ahead 0 (the synchronous loop): one step's groups, then nothing until the version moves;
    a group refunded (unusable for training) lets exactly one more through at once."""
    served = 0

    def version() -> int:
        return served

    async def main() -> None:
        nonlocal served
        pacer = Pacer(groups_per_step=2, max_ahead=0, stall_s=3600)
        done = asyncio.Event()
        assert await pacer.acquire(version, done) and await pacer.acquire(version, done)
        third = asyncio.create_task(pacer.acquire(version, done))
        finished, _ = await asyncio.wait({third}, timeout=0.3)
        assert not finished  # the step's two groups are out; nothing more during training
        pacer.refund()
        async with asyncio.timeout(5):
            assert await third
        fourth = asyncio.create_task(pacer.acquire(version, done))
        finished, _ = await asyncio.wait({fourth}, timeout=0.3)
        assert not finished
        served = 1  # the next version (the version watch kicks the pacer): the next step's groups
        pacer.kick()
        async with asyncio.timeout(5):
            assert await fourth
        assert await pacer.acquire(version, done)
        last = asyncio.create_task(pacer.acquire(version, done))
        done.set()
        async with asyncio.timeout(5):
            assert await last is False  # the run ended while it waited

    asyncio.run(main())


# ------------------------------------------------------------------------------ a task whose episodes cannot run


class _Broken:
    """Episodes that fail before any call (as when an agent's tool server cannot start) where ``fails(n)`` holds
    for the n-th episode started (from 1), and finish otherwise. No call reaches the gateway: the runner's
    bookkeeping is what is checked."""

    def __init__(self, fails: Callable[[int], bool] = lambda n: True) -> None:
        self.calls, self.fails = 0, fails

    def sample(self, rng: random.Random) -> int:
        return rng.randint(0, 9)

    async def episode(self, gateway: object, problem: int, group_id: str, group_size: int) -> Outcome:
        self.calls += 1
        call = self.calls
        await asyncio.sleep(0)
        if self.fails(call):
            raise ModuleNotFoundError("No module named 'mcp'")
        return Outcome(reward=1.0, version=0)


def test_a_task_whose_first_episodes_all_fail_ends_the_run_with_its_first_error() -> None:
    lines: list[str] = []
    task = _Broken()
    board = asyncio.run(run_groups("http://127.0.0.1:9", task, group_size=8, concurrency=4,  # type: ignore[arg-type]
                                   limits=RunLimits(max_seconds=60, give_up_failures=16), emit=lines.append))
    assert board.gave_up and board.first_error == "ModuleNotFoundError: No module named 'mcp'"
    assert 16 <= board.failed <= 16 + 4 * 8 and task.calls == board.failed, "the groups in flight finish, no more"
    assert any("first error: ModuleNotFoundError" in line for line in lines)
    assert board.summary()["gave_up"] is True


def test_failures_after_a_finished_episode_do_not_end_the_run() -> None:
    task = _Broken(fails=lambda n: 8 < n <= 40)  # one good group, then four failed ones, then good again
    board = asyncio.run(run_groups("http://127.0.0.1:9", task, group_size=8, concurrency=1,  # type: ignore[arg-type]
                                   limits=RunLimits(until_version=0, stop_groups=2, give_up_failures=16),
                                   emit=lambda _: None))
    assert not board.gave_up and board.failed == 32 and board.versions[0].n == 16


def test_give_up_failures_zero_never_gives_up() -> None:
    task = _Broken(fails=lambda n: n <= 40)
    board = asyncio.run(run_groups("http://127.0.0.1:9", task, group_size=8, concurrency=1,  # type: ignore[arg-type]
                                   limits=RunLimits(until_version=0, stop_groups=1, give_up_failures=0),
                                   emit=lambda _: None))
    assert not board.gave_up and board.failed == 40
