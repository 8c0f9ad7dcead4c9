"""The strict parser of a judge's answer: one JSON object, exactly one integer score in range per
trajectory label, nothing else. Anything else raises ``BadAnswer`` (the client asks again)."""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from .prompt import labels


class BadAnswer(ValueError):
    """A judge answer that cannot be used; the message says why."""


@dataclass(frozen=True, slots=True)
class Verdict:
    scores: list[int]
    """One per trajectory, in the group's order, each in [0, max_score]."""
    explanation: str


def parse_answer(text: str | None, n: int, max_score: int) -> Verdict:
    if not text:
        raise BadAnswer("empty answer")
    body = text.strip()
    if body.startswith("```"):  # a fenced block is the one leniency: models add it unasked
        body = body.strip("`").removeprefix("json").strip()
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadAnswer(f"not JSON: {exc}") from None
    if not isinstance(data, dict) or set(data) != {"explanation", "scores"}:
        raise BadAnswer("the answer must be an object with exactly 'explanation' and 'scores'")
    explanation, scores = data["explanation"], data["scores"]
    if not isinstance(explanation, str):
        raise BadAnswer("explanation must be a string")
    want = labels(n)
    if not isinstance(scores, dict) or set(scores) != set(want):
        got = sorted(scores) if isinstance(scores, dict) else type(scores).__name__
        raise BadAnswer(f"scores must have exactly the keys {want}, got {got}")
    out = []
    for label in want:
        s = scores[label]
        if isinstance(s, bool) or not isinstance(s, int | float) or not 0 <= s <= max_score or s != int(s):
            raise BadAnswer(f"score of {label} must be an integer in [0, {max_score}], got {s!r}")
        out.append(int(s))
    return Verdict(out, explanation)
