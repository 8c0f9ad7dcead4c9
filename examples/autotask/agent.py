"""A task described in one line, with no reward function: a model served through the gateway writes the
training inputs from the description, the agent answers each, and ``streamrl judge`` scores every group
against a rubric made from the description (docs/judge.md), relative to the group's other answers.

Train:    streamrl up --judge --demo --demo-task examples.autotask.agent:AutoTask --model smollm2-135m
          (another description: a function of your own returning ``AutoTask(description=...)``)
"""

from __future__ import annotations

import asyncio
import random
import re
from dataclasses import dataclass, field

from streamrl.producers.agent import AgentTask
from streamrl.producers.client import AsyncGateway, AsyncTrajectory
from streamrl.producers.episode import Outcome

GENERATE = ("Here is a task: {description}\nWrite {n} different inputs someone might give for this task, one per "
            "line, without numbering and without answers.")
_NUMBERING = re.compile(r"^\s*(?:[-*•]|\d+[.)])\s*")


def parse_inputs(text: str, limit: int, max_chars: int = 500) -> list[str]:
    """The distinct non-empty lines of a generation, list markers and numbering removed, at most ``limit``; a line
    longer than ``max_chars`` is dropped (a runaway line, which no answer's context might hold, would fail every
    episode drawing it)."""
    seen: dict[str, None] = {}
    for line in text.splitlines():
        line = _NUMBERING.sub("", line).strip()
        if line and len(line) <= max_chars:
            seen.setdefault(line)
    return list(seen)[:limit]


@dataclass
class AutoTask(AgentTask):
    description: str = "Summarise a short product review in one sentence."
    model: str = "policy"
    temperature: float = 1.0
    max_tokens: int = 128
    n_inputs: int = 32
    generator_model: str | None = None
    """The model that writes the inputs (default: ``model``, as the gateway serves it when generation starts)."""
    generation_max_tokens: int = 1024
    max_input_chars: int = 500
    """Generated inputs longer than this are dropped."""
    rubric: str | None = None
    """What the judge scores by (default: how well each reply does the task described)."""
    _inputs: list[str] = field(default_factory=list, init=False, repr=False)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.description.strip():
            raise ValueError("the task needs a description")
        if self.n_inputs < 1:
            raise ValueError("n_inputs must be >= 1")
        if self.rubric is None:
            self.rubric = f"The task: {self.description} Score how well each reply does this task for its input."

    def sample(self, rng: random.Random) -> int:
        """An index into the inputs, which are generated when the first episode runs (it has the gateway)."""
        return rng.randrange(self.n_inputs)

    async def inputs(self, gateway: AsyncGateway) -> list[str]:
        """The generated inputs, written once by ``generator_model`` in a call marked ``judge`` (recorded as
        the environment's, never trained on)."""
        async with self._lock:
            if not self._inputs:
                async with gateway.trajectory(purpose="judge") as t:
                    reply = await t.client.chat.completions.create(
                        model=self.generator_model or self.model, max_tokens=self.generation_max_tokens,
                        messages=[{"role": "user", "content": GENERATE.format(description=self.description,
                                                                               n=self.n_inputs)}])
                self._inputs = parse_inputs(reply.choices[0].message.content or "", self.n_inputs,
                                            self.max_input_chars)
                if not self._inputs:
                    raise RuntimeError(f"{self.generator_model or self.model} wrote no inputs of at most "
                                       f"{self.max_input_chars} characters for {self.description!r}")
        return self._inputs

    async def episode(self, gateway: AsyncGateway, problem: int, group_id: str, group_size: int) -> Outcome:
        inputs = await self.inputs(gateway)
        return await super().episode(gateway, inputs[problem % len(inputs)], group_id, group_size)

    async def play(self, t: AsyncTrajectory, problem: str, *, model: str, temperature: float) -> None:
        await t.client.chat.completions.create(
            model=model, max_tokens=self.max_tokens, temperature=temperature,
            messages=[{"role": "system", "content": self.description}, {"role": "user", "content": problem}])
        t.judge(self.rubric)
