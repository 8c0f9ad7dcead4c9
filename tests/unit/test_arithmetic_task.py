"""The arithmetic task's reward and held-out split."""

from __future__ import annotations

import random

import pytest

from streamrl.producers.arithmetic import HELD_OUT, ArithmeticTask, final_number, make_problem, reward


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


def test_demonstrations_work_the_sum_out_and_score_one() -> None:
    """SFT warm-up data the task writes itself: the question as asked, a reply that writes the computation out
    and ends in the answer (reward 1), never a held-out problem."""
    task, rng = ArithmeticTask(), random.Random(3)
    held_out = {p.key for p in HELD_OUT}
    for _ in range(500):
        problem = task.sample(rng)
        user, assistant = task.demonstration(problem)
        assert user == task.messages(problem)[0] and problem.key not in held_out
        assert assistant["role"] == "assistant" and " = " in assistant["content"]
        assert reward(assistant["content"], problem.answer) == 1.0
    assert task.demonstration(HELD_OUT[0])[1]["content"] == "19 - 7 = 12"
