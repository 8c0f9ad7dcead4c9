"""What every example environment returns per trajectory, and how it reads the serving version."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .client import VERSION_HEADER


@dataclass(frozen=True, slots=True)
class Outcome:
    """One finished trajectory: its reward and the newest policy version that served any of its calls
    (None when the gateway did not say, e.g. talking to vLLM directly)."""

    reward: float
    version: int | None
    trajectory_id: str = ""
    turns: int = 1
    reply_tokens: int | None = None
    """Tokens sampled for it (every call's ``usage.completion_tokens`` summed), for exact reply lengths in
    the demo summary; None when a response did not say."""


def served_version(headers: Any) -> int | None:
    """The ``X-Policy-Version`` response header as an int (0 = base model), None if absent or odd."""
    value = headers.get(VERSION_HEADER)
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def completion_tokens(response: Any) -> int | None:
    """A parsed chat completion's ``usage.completion_tokens``, None without a usage."""
    usage = getattr(response, "usage", None)
    tokens = getattr(usage, "completion_tokens", None)
    return tokens if isinstance(tokens, int) else None


def newest(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def final_number(text: str) -> float | None:
    """The last number written in ``text`` (the answer; ``1,200`` is 1200), or None."""
    found = _NUMBER.findall(text.replace(",", ""))
    return float(found[-1]) if found else None
