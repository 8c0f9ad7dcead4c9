"""A held-out evaluation of a multi-call task (``producers/evaluate.py``) counts an episode that ended in an error
as not answered and reports the first error, never losing the evaluation (nor, in the evaluator, the rest of the
run's): the task here raises as a framework does when the pinned version went away mid-episode (a 404)."""

from __future__ import annotations

import asyncio
import math
from typing import ClassVar

import httpx

from streamrl.producers.evaluate import evaluate_version


class Episodes:
    """Problems 0-3: 0 and 2 play to a score, 1 raises, 3 is answered by another version (None)."""

    held_out: ClassVar[list[int]] = [0, 1, 2, 3]

    async def evaluate_problem(self, gateway, problem: int, model: str, version: int) -> float | None:
        await asyncio.sleep(0)
        if problem == 1:
            raise LookupError("The model `policy@v7` does not exist.")
        return None if problem == 3 else float(problem)


class Broken(Episodes):
    async def evaluate_problem(self, gateway, problem: int, model: str, version: int) -> float | None:
        raise LookupError("gone")


def evaluate(task) -> object:
    async def main():
        async with httpx.AsyncClient(base_url="http://127.0.0.1:9") as client:  # no call reaches it
            result = await evaluate_version(client, task, "policy@v7", 7, max_tokens=8)
            assert client.event_hooks["response"] == [], "the episode hook is taken off the shared client"
            return result
    return asyncio.run(main())


def test_an_episode_that_failed_is_counted_and_the_rest_scored() -> None:
    result = evaluate(Episodes())
    assert (result.score, result.answered, result.problems, result.failed) == (1.0, 2, 4, 1)
    assert result.error == "LookupError: The model `policy@v7` does not exist."


def test_an_evaluation_where_every_episode_failed_has_no_score() -> None:
    result = evaluate(Broken())
    assert math.isnan(result.score) and result.answered == 0 and result.failed == 4


class Graded(Episodes):
    """A game's scores: won, drawn, an illegal move, won."""

    async def evaluate_problem(self, gateway, problem: int, model: str, version: int) -> float | None:
        return (1.0, 0.5, -1.0, 1.0)[problem]


class AllOrNothing(Episodes):
    async def evaluate_problem(self, gateway, problem: int, model: str, version: int) -> float | None:
        return (1.0, 0.0, 0.0, 1.0)[problem]


def test_full_marks_are_counted_where_a_score_gives_partial_credit() -> None:
    """Two wins, a draw and a loss by an illegal move: mean 0.375, full marks 2 of 4; with scores of 0 or 1 alone
    the mean is the success rate and no count is added."""
    graded = evaluate(Graded())
    assert (graded.score, graded.answered, graded.full_marks) == (0.375, 4, 2)
    binary = evaluate(AllOrNothing())
    assert (binary.score, binary.full_marks) == (0.5, None)
    assert evaluate(Episodes()).full_marks == 1  # scores 0.0 and 2.0: not all-or-nothing, and 2.0 is full marks
