"""The judge's prompt: the rubric and a group's rendered trajectories, and the JSON schema of the answer.

Trajectories are labelled ``T1``..``Tn`` in the group's order; the answer is one object with an
``explanation`` and a ``scores`` object that has exactly the labels as keys, each an integer in
[0, max_score]. Structured output makes the server sample only answers of that shape: with vLLM as a
regular expression of the exact answer (vLLM 0.32's JSON-schema grammar lets a weak model pad whitespace
between tokens until ``max_tokens``: measured with the tiny random model), with hosted APIs as the JSON
schema (``response_format``). ``parse.py`` checks every answer anyway.
"""

from __future__ import annotations

from typing import Any

SYSTEM = ("You are a strict, fair judge of AI agent trajectories. You compare several attempts at the same "
          "task and score each one relative to the others, following the rubric. Answer with JSON only.")


def labels(n: int) -> list[str]:
    return [f"T{i + 1}" for i in range(n)]


def answer_schema(n: int, max_score: int, max_explanation_chars: int) -> dict[str, Any]:
    score = {"type": "integer", "enum": list(range(max_score + 1))}
    return {
        "type": "object",
        "properties": {
            "explanation": {"type": "string", "maxLength": max_explanation_chars},
            "scores": {"type": "object", "properties": {label: score for label in labels(n)},
                       "required": labels(n), "additionalProperties": False},
        },
        "required": ["explanation", "scores"],
        "additionalProperties": False,
    }


def messages(rubric: str, rendered: list[str], max_score: int) -> list[dict[str, str]]:
    parts = [f"Rubric: {rubric}", "",
             f"There are {len(rendered)} trajectories. Score each with an integer from 0 (worst) to {max_score} "
             "(best), relative to the others: a better trajectory gets a higher score.", ""]
    for label, text in zip(labels(len(rendered)), rendered, strict=True):
        parts += [f"<trajectory id=\"{label}\">", text, "</trajectory>", ""]
    keys = ", ".join(f'"{label}": <score>' for label in labels(len(rendered)))
    parts.append(f'Answer with one JSON object: {{"explanation": "<why, briefly>", "scores": {{{keys}}}}}')
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "\n".join(parts)}]


def answer_regex(n: int, max_score: int, max_explanation_chars: int) -> str:
    """The exact answer as a regular expression: the explanation without quotes, backslashes or control
    characters (so it needs no escapes), then every label once, in order, with an integer score."""
    score = "(" + "|".join(str(i) for i in range(max_score, -1, -1)) + ")"
    scores = ", ".join(f'"{label}": {score}' for label in labels(n))
    explanation = r'"[^"\\\x00-\x1f]{0,' + str(max_explanation_chars) + '}"'
    return r'\{"explanation": ' + explanation + r', "scores": \{' + scores + r'\}\}'


def answer_tokens(n: int, max_score: int, max_explanation_chars: int) -> int:
    """Tokens the longest answer of that shape can take, counting a token as at least one character (an
    explanation of unusual characters may need more; its answer is then cut, refused and asked again). The
    judge asks for no more than this, so a large group's prompt still fits the judge model's context."""
    scores = ", ".join(f'"{label}": {max_score}' for label in labels(n))
    return len('{"explanation": "", "scores": {}}') + max_explanation_chars + len(scores)
