"""Held-out evaluation of every published policy version, through the gateway, never trained on.

The evaluator watches the gateway's routed policy version (``GET /health``). For each new version (every
``every``-th; version 0, the base model, first) it sends the task's whole held-out set at once, pinned to
that version (``policy@v<N>``: its requests hold the version loaded while they run), greedy
(temperature 0), marked ``X-Streamrl-Purpose: eval``: the gateway records them with ``purpose`` ``eval``
and the trainer never trains on them (``trainer/assembler.py``). No reward is posted; the score is
computed here, written as one JSON line per version and reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx
from httpx_aiohttp import HttpxAiohttpClient

from streamrl.broker.schema import served_name

from .client import PURPOSE_HEADER, VERSION_HEADER, AsyncGateway
from .runner import describe, gateway_version


class HeldOutTask(Protocol):
    """A task that can be scored on problems it never trains on."""

    held_out: Sequence[Any]

    def messages(self, problem: Any) -> list[dict[str, str]]: ...

    def score(self, problem: Any, reply: str) -> float: ...


@dataclass(frozen=True, slots=True)
class EvalResult:
    version: int
    score: float
    """Mean score over the problems answered (accuracy for 0/1 rewards)."""
    answered: int
    problems: int
    seconds: float
    time: float
    failed: int = 0
    """Episodes that ended in an error (their version retired mid-way, a framework's exception): not answered."""
    error: str = ""
    """The first such error, for the log."""
    full_marks: int | None = None
    """Problems scored 1.0 or more, a task's full reward (a won game, an exact answer), where some score was
    neither 0 nor 1 (a draw, a rung of partial credit): the success rate, which such a mean cannot tell. None
    where every score was 0 or 1: the score is then the success rate."""


async def evaluate_version(client: httpx.AsyncClient, task: HeldOutTask, model: str, version: int,
                           max_tokens: int) -> EvalResult:
    """The held-out set at once, pinned to ``model``; answers from another version do not count. A task that
    plays whole episodes (``agent.AgentTask``: several calls, a framework's loop) plays each one itself."""
    started = time.monotonic()
    if hasattr(task, "evaluate_problem"):
        # on ``client``'s pool (not closed here): every episode holds the pinned version, as one call does
        gateway = AsyncGateway(str(client.base_url), http_client=client)
        try:
            outcomes = await asyncio.gather(*(task.evaluate_problem(gateway, p, model, version)
                                              for p in task.held_out), return_exceptions=True)
        finally:
            client.event_hooks["response"].remove(gateway.served.async_hook)
        for o in outcomes:
            if isinstance(o, BaseException) and not isinstance(o, Exception):
                raise o  # cancelled: the evaluation is being dropped
        errors = [o for o in outcomes if isinstance(o, Exception)]
        scores = [o for o in outcomes if isinstance(o, int | float)]
        return EvalResult(version, sum(scores) / len(scores) if scores else float("nan"), len(scores),
                          len(task.held_out), time.monotonic() - started, time.time(), len(errors),
                          describe(errors[0])[:300] if errors else "", _full_marks(scores))

    async def one(i: int, problem: Any) -> float | None:
        r = await client.post("/v1/chat/completions", json={
            "model": model, "messages": task.messages(problem), "max_tokens": max_tokens, "temperature": 0.0,
        }, headers={PURPOSE_HEADER: "eval", "X-Trajectory-Id": f"eval-v{version}-{i}"})
        if r.status_code != 200 or r.headers.get(VERSION_HEADER) != str(version):
            return None
        return task.score(problem, r.json()["choices"][0]["message"]["content"] or "")

    scores = [s for s in await asyncio.gather(*(one(i, p) for i, p in enumerate(task.held_out))) if s is not None]
    ended = [f"eval-v{version}-{i}" for i in range(len(task.held_out))]
    with contextlib.suppress(httpx.HTTPError):  # the pinned version is let go now, not pinned_hold_s later
        await client.post("/v1/trajectories/end", json={"trajectory_ids": ended})  # a refusal changes nothing else
    return EvalResult(version, sum(scores) / len(scores) if scores else float("nan"), len(scores),
                      len(task.held_out), time.monotonic() - started, time.time(), full_marks=_full_marks(scores))


def _full_marks(scores: Sequence[float]) -> int | None:
    return None if all(s in (0, 1) for s in scores) else sum(s >= 1.0 for s in scores)


class Evaluator:
    """Evaluates each new routed version of ``policy_name`` until stopped; results go to ``out`` (JSONL)."""

    def __init__(self, url: str, task: HeldOutTask, *, policy_name: str = "policy", every: int = 1,
                 max_tokens: int = 32, out: Path | None = None, emit: Callable[[str], None] = print) -> None:
        if every < 1:
            raise ValueError("every must be >= 1")
        self.url, self.task, self.policy_name, self.every = url.rstrip("/"), task, policy_name, every
        self.max_tokens, self.out, self.emit = max_tokens, out, emit
        self.results: list[EvalResult] = []

    async def run(self, stop: asyncio.Event, poll_s: float = 0.25) -> list[EvalResult]:
        done: set[int] = set()
        # every problem's request in flight at once: the gateway keeps a pinned version loaded while any
        # request holds it, so a pool smaller than the set would let it unload between two waves; aiohttp's
        # pool, as the producer's (``client.AsyncGateway``): httpcore's costs milliseconds per request here
        limits = httpx.Limits(max_connections=len(self.task.held_out) + 4)
        async with HttpxAiohttpClient(base_url=self.url, timeout=600, limits=limits) as client:
            while True:
                version = await gateway_version(client, self.url, self.policy_name)
                if version is not None and version not in done and version % self.every == 0:
                    done.add(version)
                    try:
                        await self.evaluate(client, version)
                    except Exception as exc:  # one version's evaluation lost, not the rest of the run's
                        self.emit(f"eval v{version}: failed ({type(exc).__name__}: {exc}); going on")
                if stop.is_set():
                    return self.results
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(poll_s):
                        await stop.wait()

    async def evaluate(self, client: httpx.AsyncClient, version: int) -> EvalResult:
        model = self.policy_name if version == 0 else served_name(self.policy_name, version)
        result = await evaluate_version(client, self.task, model, version, self.max_tokens)
        self.results.append(result)
        if self.out is not None:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            with open(self.out, "a") as f:
                f.write(json.dumps(asdict(result)) + "\n")
        with contextlib.suppress(httpx.HTTPError):  # shown on the gateway's dashboard; a gateway without one 404s
            await client.post("/dashboard/eval", json={"version": version, "score": result.score,
                                                       "answered": result.answered, "problems": result.problems,
                                                       "policy": self.policy_name})
        failed = f"; {result.failed} failed, first: {result.error}" if result.failed else ""
        full = f"; full marks {result.full_marks}/{result.answered}" if result.full_marks is not None else ""
        self.emit(f"eval v{version}: held-out score {result.score:.3f} ({result.answered}/{result.problems} "
                  f"answered by v{version}{full}) in {result.seconds:.1f} s{failed}")
        return result


async def evaluate_once(url: str, task: HeldOutTask, *, policy_name: str = "policy", version: int | None = None,
                        max_tokens: int = 32) -> EvalResult:
    """The held-out score of one version (default: the one the gateway routes ``policy_name`` to now)."""
    async with HttpxAiohttpClient(base_url=url.rstrip("/"), timeout=600,
                                  limits=httpx.Limits(max_connections=len(task.held_out) + 4)) as client:
        if version is None:
            version = await gateway_version(client, url, policy_name)
            if version is None:
                raise ValueError(f"{url} does not serve {policy_name!r} (GET /health)")
        model = policy_name if version == 0 else served_name(policy_name, version)
        return await evaluate_version(client, task, model, version, max_tokens)


def main(argv: list[str] | None = None) -> int:
    """``python -m streamrl.producers.evaluate TASK --gateway URL``: a task's held-out score on one version."""
    import argparse

    from .demo_cli import DemoConfig

    p = argparse.ArgumentParser(prog="python -m streamrl.producers.evaluate", description=main.__doc__)
    p.add_argument("task", help="numbers | calculator | arithmetic | module:attr (an agent task of yours)")
    p.add_argument("--gateway", default="http://127.0.0.1:8080")
    p.add_argument("--model", default="policy", help="the policy name the gateway serves")
    p.add_argument("--version", type=int, help="the version to score (default: the one served now; 0: the base model)")
    p.add_argument("--task-options", type=json.loads, default={}, metavar="JSON",
                   help='the agent task\'s own settings, as in training (e.g. \'{"first_tool": "search_inbox"}\')')
    args = p.parse_args(argv)
    try:
        task = DemoConfig(task=args.task, model=args.model, task_options=args.task_options).make_task()
        if not getattr(task, "held_out", None):
            raise ValueError(f"task {args.task!r} has no held-out set")
        result = asyncio.run(evaluate_once(args.gateway, task, policy_name=args.model, version=args.version,  # type: ignore[arg-type]
                                           max_tokens=getattr(task, "max_tokens", 32)))
    except ValueError as exc:
        p.error(str(exc))
    print(json.dumps(asdict(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
