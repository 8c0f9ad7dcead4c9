"""A real task with a verifiable reward: arithmetic word problems; reward 1 when the reply's last number is
the answer, else 0.

Problems are drawn from templates and operands by a seeded generator, so a run is reproducible. A fixed
held-out set (``HELD_OUT``, drawn from its own seed) is never sampled for training: ``sample`` skips
those problems, and the evaluator (``producers/evaluate.py``) measures each published version on them.
Sized for SmolLM2-135M-Instruct, which answers some of them right from the start ("What is 12 + 7?"
-> "12 + 7 = 9" as often as "19"): a group of samples at temperature 1 then has both rewards, which is
what GRPO needs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .client import AsyncGateway
from .episode import Outcome, completion_tokens, final_number, served_version

NAMES = ("Tom", "Anna", "Ravi", "Mei", "Omar", "Lena", "Sam", "Ines")
ITEMS = ("apple", "book", "marble", "coin", "card", "shell", "pencil", "stamp")
INSTRUCTION = "Answer with just the number."
JUDGE_RUBRIC = ("The user asked an arithmetic word problem and to answer with just the number. Score a "
                "trajectory high when its final number is the correct answer, low when it is wrong or missing.")
"""The judge's rubric for the arithmetic task with ``streamrl up --demo-reward judge``."""


@dataclass(frozen=True, slots=True)
class Problem:
    question: str
    answer: int
    working: str = ""
    """The computation written out, ending in the answer ("12 + 7 = 19"): what a demonstration replies."""

    @property
    def key(self) -> str:
        return self.question


def make_problem(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    op = rng.choice("+-*/")
    if op == "+":
        a, b = rng.randint(2, 30), rng.randint(2, 30)
        q, ans = f"{name} has {a} {item}s and gets {b} more. How many {item}s does {name} have now?", a + b
        work = f"{a} + {b} = {ans}"
    elif op == "-":
        a = rng.randint(5, 40)
        b = rng.randint(1, a - 1)
        q, ans = f"{name} had {a} {item}s and gave {b} away. How many {item}s are left?", a - b
        work = f"{a} - {b} = {ans}"
    elif op == "*":
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        q, ans = f"A box holds {a} {item}s. How many {item}s are in {b} boxes?", a * b
        work = f"{b} x {a} = {ans}"
    else:
        b, ans = rng.randint(2, 6), rng.randint(2, 9)
        q = f"{name} shares {ans * b} {item}s equally among {b} friends. How many {item}s does each friend get?"
        work = f"{ans * b} / {b} = {ans}"
    return Problem(q, ans, work)


def _held_out(n: int, seed: int = 20261201) -> tuple[Problem, ...]:
    """``n`` distinct problems, the i-th drawn from its own seed: a prefix of the set never changes."""
    problems: dict[str, Problem] = {}
    i = 0
    while len(problems) < n:
        p = make_problem(random.Random(seed + i))
        problems.setdefault(p.key, p)
        i += 1
    return tuple(problems.values())


HELD_OUT: tuple[Problem, ...] = _held_out(256)
"""Never sampled for training; an evaluation scores a prefix of it (``ArithmeticTask.held_out_size``)."""
_HELD_OUT_KEYS = frozenset(p.key for p in HELD_OUT)

def reward(text: str, answer: int) -> float:
    """1.0 when the reply's last number equals the answer, else 0.0."""
    value = final_number(text)
    return 1.0 if value is not None and value == answer else 0.0


@dataclass(frozen=True, slots=True)
class ArithmeticTask:
    """Sampling settings. temperature 1.0: the behaviour policy is the model's own distribution.

    SmolLM2-135M-Instruct often ignores the instruction and explains at length: at temperature 1 its
    replies run from 2 tokens to past 128 (mean 64 on the first held-out problems), so ``max_tokens``
    decides how long and how varied a group's replies are (and how long a synchronous loop waits for
    the slowest of a batch)."""

    model: str = "policy"
    max_tokens: int = 32
    temperature: float = 1.0
    held_out_size: int = 64
    """How many of ``HELD_OUT`` an evaluation scores (at most 256; the first 64 on a CPU, more on a GPU
    where a larger set costs nothing and resolves smaller differences)."""
    judge_rubric: str | None = None
    """When given, each trajectory asks ``streamrl judge`` for its reward by this rubric instead of posting
    the exact-match one (docs/judge.md); the exact-match score is still what the episode reports, so the
    demo's figures and the held-out evaluation stay comparable with an exact-match run."""

    def __post_init__(self) -> None:
        if not 1 <= self.held_out_size <= len(HELD_OUT):
            raise ValueError(f"held_out_size must be 1..{len(HELD_OUT)}, not {self.held_out_size}")

    @property
    def held_out(self) -> tuple[Problem, ...]:
        """Scored by ``producers/evaluate.py`` for each version; never sampled for training."""
        return HELD_OUT[:self.held_out_size]

    def score(self, problem: Problem, reply: str) -> float:
        return reward(reply, problem.answer)

    def sample(self, rng: random.Random) -> Problem:
        """A training problem: never one of the held-out set."""
        while True:
            problem = make_problem(rng)
            if problem.key not in _HELD_OUT_KEYS:
                return problem

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        return [{"role": "user", "content": f"{problem.question} {INSTRUCTION}"}]

    def demonstration(self, problem: Problem) -> list[dict[str, str]]:
        """A correct exchange, as chat messages: SFT warm-up data written by the task itself (reward 1). The
        reply writes the computation out before the answer: trained on the bare number, SmolLM2-135M learnt
        to answer in 3 tokens and stopped working the sum out, which capped what RL could reach from there
        (docs/benchmarks.md, "RL from an SFT warm-up")."""
        return [*self.messages(problem), {"role": "assistant", "content": problem.working}]

    async def episode(self, gateway: AsyncGateway, problem: Problem, group_id: str, group_size: int) -> Outcome:
        async with gateway.trajectory(group_id=group_id, group_size=group_size) as t:
            raw = await t.client.chat.completions.with_raw_response.create(
                model=self.model, messages=self.messages(problem),  # type: ignore[arg-type]
                max_tokens=self.max_tokens, temperature=self.temperature)
            reply = raw.parse()
            score = reward(reply.choices[0].message.content or "", problem.answer)
            if self.judge_rubric is None:
                t.reward(score)
            else:
                t.judge(self.judge_rubric)
        return Outcome(score, served_version(raw.headers), t.trajectory_id, reply_tokens=completion_tokens(reply))
