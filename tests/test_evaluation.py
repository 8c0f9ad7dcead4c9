"""The arithmetic task's reward and held-out split, and held-out evaluation through the real gateway: its
requests are recorded with purpose ``eval`` and the trainer never holds them."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_gateway import of_request

from streamrl.broker.schema import RewardRecord, decode, encode
from streamrl.producers.arithmetic import HELD_OUT, ArithmeticTask, final_number, make_problem, reward
from streamrl.producers.client import PURPOSE_HEADER
from streamrl.producers.evaluate import Evaluator
from streamrl.trainer.assembler import Assembler


@pytest.mark.parametrize(("reply", "answer", "expected"), [
    ("19", 19, 1.0),
    ("12 + 7 = 19", 19, 1.0),
    ("12 + 7 = 9", 19, 0.0),             # the last number is the answer given
    ("The answer is 1,200.", 1200, 1.0),
    ("It is -3", -3, 1.0),
    ("19.0", 19, 1.0),
    ("19.5", 19, 0.0),
    ("nineteen", 19, 0.0),
    ("", 19, 0.0),
    ("19 apples, so 20", 19, 0.0),
])
def test_reward_is_the_exact_match_of_the_last_number(reply: str, answer: int, expected: float) -> None:
    assert reward(reply, answer) == expected


def test_problems_are_right_and_the_held_out_set_is_never_sampled() -> None:
    rng = random.Random(0)
    for _ in range(500):
        p = make_problem(rng)
        numbers = [int(x) for x in p.question.replace("?", " ").replace(".", " ").split() if x.isdigit()]
        a, b = numbers
        assert p.answer in (a + b, a - b, a * b) or (b * p.answer == a)  # a/b shares a in b parts
        assert p.answer > 0 and final_number(p.question) == b  # the question's own last number is an operand
    held_out = {p.key for p in HELD_OUT}
    assert len(held_out) == len(HELD_OUT) == 256
    task, rng = ArithmeticTask(), random.Random(1)
    assert not any(task.sample(rng).key in held_out for _ in range(5000))
    # fixed across runs and versions of this code: evaluations stay comparable (Python's Random is stable)
    assert (HELD_OUT[0].question, HELD_OUT[0].answer) == (
        "Ravi had 19 coins and gave 7 away. How many coins are left?", 12)
    assert (HELD_OUT[63].question, HELD_OUT[63].answer) == (
        "Ravi has 9 coins and gets 5 more. How many coins does Ravi have now?", 14)
    assert task.messages(HELD_OUT[0]) == [{"role": "user", "content": (
        "Ravi had 19 coins and gave 7 away. How many coins are left? Answer with just the number.")}]


def test_an_evaluation_scores_a_prefix_of_the_held_out_set() -> None:
    assert ArithmeticTask().held_out == HELD_OUT[:64]  # the CPU default: a few seconds per version
    assert ArithmeticTask(held_out_size=256).held_out == HELD_OUT
    for bad in (0, 257):
        with pytest.raises(ValueError, match=r"held_out_size must be 1\.\.256"):
            ArithmeticTask(held_out_size=bad)


@dataclass(frozen=True)
class FewHeldOut:
    """Four held-out problems of the arithmetic task (the tiny random model answers them, wrongly)."""

    held_out: tuple[Any, ...] = HELD_OUT[:4]

    def messages(self, problem: Any) -> list[dict[str, str]]:
        return ArithmeticTask().messages(problem)

    def score(self, problem: Any, reply: str) -> float:
        return reward(reply, problem.answer)


def test_evaluation_is_recorded_as_eval_and_never_held_by_the_trainer(engine_gateway, completions, tmp_path: Path) -> None:
    out = tmp_path / "eval.jsonl"
    lines: list[str] = []
    evaluator = Evaluator(engine_gateway.url, FewHeldOut(), max_tokens=8, out=out, emit=lines.append)
    stop = asyncio.Event()
    stop.set()  # evaluate what is routed now (the base model, version 0), then return
    [result] = asyncio.run(evaluator.run(stop))
    assert (result.version, result.answered, result.problems) == (0, 4, 4) and 0.0 <= result.score <= 1.0
    assert json.loads(out.read_text())["version"] == 0 and lines[0].startswith("eval v0: held-out score")
    shown = engine_gateway.gateway.dashboard.versions[0].eval  # posted to the gateway's dashboard too
    assert shown is not None and shown["score"] == result.score and shown["problems"] == 4
    records = completions.wait_for(lambda r: r.trajectory_id.startswith("eval-v0-"), count=4)
    assert {r.purpose for r in records} == {"eval"}
    # even with rewards posted for them, the trainer's assembler never holds an evaluation
    assembler = Assembler(group_size=4, group_timeout_s=60, ttl_s=60, max_trajectories=100)
    for r in records[:4]:
        assembler.add(decode(encode(r)), b"", now=0.0)
        assembler.add(RewardRecord(r.trajectory_id, 1.0, group_id="g", group_size=4), b"", now=0.0)
    assert assembler.counts["not_trained_eval"] == 4 and assembler.poll(now=0.0) == []
    assert not assembler.trajectories or all(not t.completions for t in assembler.trajectories.values())


def test_purpose_is_validated_and_train_is_the_default(engine_gateway, completions, engine) -> None:
    model = httpx.get(f"{engine.url}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    bad = httpx.post(f"{engine_gateway.url}/v1/chat/completions", json=body, headers={PURPOSE_HEADER: "judge-me"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "purpose"
    r = httpx.post(f"{engine_gateway.url}/v1/chat/completions", json=body | {"metadata": {"purpose": "eval"}})
    assert r.status_code == 200
    plain = httpx.post(f"{engine_gateway.url}/v1/chat/completions", json=body)
    rec = completions.wait_for(of_request(r.headers["x-request-id"]))[0]
    assert rec.purpose == "eval"
    assert completions.wait_for(of_request(plain.headers["x-request-id"]))[0].purpose == "train"
