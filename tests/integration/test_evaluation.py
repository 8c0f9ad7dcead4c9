"""Held-out evaluation through the real gateway: its requests are recorded with purpose ``eval`` and the
trainer never holds them (the arithmetic task's reward and held-out split: ``tests/unit/test_arithmetic_task.py``)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from support.gateway_calls import of_request

from streamrl.broker.schema import RewardRecord, decode, encode
from streamrl.producers.arithmetic import HELD_OUT, ArithmeticTask, reward
from streamrl.producers.client import PURPOSE_HEADER
from streamrl.producers.evaluate import Evaluator
from streamrl.trainer.assembler import Assembler


@dataclass(frozen=True)
class FewHeldOut:
    """Four held-out problems of the arithmetic task (the tiny random model answers them, wrongly)."""

    held_out: tuple[Any, ...] = HELD_OUT[:4]

    def messages(self, problem: Any) -> list[dict[str, str]]:
        return ArithmeticTask().messages(problem)

    def score(self, problem: Any, reply: str) -> float:
        return reward(reply, problem.answer)


def ends_told(url: str) -> float:
    """How many ``POST /v1/trajectories/end`` the gateway answered 200 (its ``/metrics``)."""
    line = 'streamrl_gateway_requests_total{route="/v1/trajectories/end",status="200"} '
    found = [x for x in httpx.get(f"{url}/metrics").text.splitlines() if x.startswith(line)]
    return float(found[0][len(line):]) if found else 0.0


def test_evaluation_is_recorded_as_eval_and_never_held_by_the_trainer(engine_gateway, completions, tmp_path: Path) -> None:
    out = tmp_path / "eval.jsonl"
    lines: list[str] = []
    evaluator = Evaluator(engine_gateway.url, FewHeldOut(), max_tokens=8, out=out, emit=lines.append)
    stop = asyncio.Event()
    stop.set()  # evaluate what is routed now (the base model, version 0), then return
    ends_before = ends_told(engine_gateway.url)
    [result] = asyncio.run(evaluator.run(stop))
    assert (result.version, result.answered, result.problems) == (0, 4, 4) and 0.0 <= result.score <= 1.0
    assert json.loads(out.read_text())["version"] == 0 and lines[0].startswith("eval v0: held-out score")
    shown = engine_gateway.gateway.dashboard.versions[0].eval  # posted to the gateway's dashboard too
    assert shown is not None and shown["score"] == result.score and shown["problems"] == 4
    assert ends_told(engine_gateway.url) == ends_before + 1, "the episodes' end is told, in one request"
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
