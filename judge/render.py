"""A trajectory's conversation as plain text for the judge: messages, tool calls and tool results.

A trajectory's calls (in log order) usually each resend the whole conversation so far, so the last call's
messages plus its answer are the whole trajectory; an earlier call whose answer the next call does not
resend (an agent that trims its context) is rendered before it, so nothing the agent did is hidden.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from streamrl.broker.schema import CompletionRecord


@dataclass(frozen=True, slots=True)
class Call:
    """What the judge keeps of one completion record: no tokens, only what it renders."""

    messages: tuple[tuple[str, str], ...]
    """(role, text) of each message sent (a completions-endpoint prompt: one ``prompt`` message)."""
    answer: str
    """The reply and its tool calls, rendered."""

    @classmethod
    def of(cls, record: CompletionRecord) -> Call:
        request = record.request if isinstance(record.request, dict) else {}
        if isinstance(request.get("messages"), list):
            messages = tuple(_message(m) for m in request["messages"])
        elif "prompt" in request:
            messages = (("prompt", _text(request["prompt"])),)
        else:
            messages = ()
        return cls(messages, _answer(record.response_text, record.tool_calls))


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: keep the text ones
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else orjson.dumps(content).decode()


def _tool_calls(calls: Any) -> str:
    out = []
    for c in calls or ():
        f = c.get("function", {}) if isinstance(c, dict) else {}
        out.append(f"[tool call {f.get('name', '?')}({f.get('arguments', '')})]")
    return "\n".join(out)


def _message(m: Any) -> tuple[str, str]:
    if not isinstance(m, dict):
        return ("?", _text(m))
    role = str(m.get("role", "?"))
    text = _text(m.get("content"))
    if m.get("tool_calls"):
        text = "\n".join(t for t in (text, _tool_calls(m["tool_calls"])) if t)
    if role == "tool":
        role = f"tool result{' ' + str(m['name']) if m.get('name') else ''}"
    return (role, text)


def _answer(text: str, tool_calls: Any) -> str:
    return "\n".join(t for t in (text, _tool_calls(tool_calls)) if t)


def render(calls: list[Call], max_chars: int) -> str:
    """The conversation of a trajectory's calls; longer than ``max_chars``, its start and end are kept."""
    lines: list[str] = []
    for i, call in enumerate(calls):
        nxt = calls[i + 1] if i + 1 < len(calls) else None
        if nxt is not None and any(role == "assistant" and text == call.answer for role, text in nxt.messages):
            continue  # the next call resends this answer: it renders it in its place
        if not lines:
            shown = call.messages
        else:  # only what this call adds to what is already shown
            shown = tuple(m for m in call.messages if f"{m[0]}: {m[1]}" not in lines)
        lines += [f"{role}: {text}" for role, text in shown]
        lines.append(f"assistant: {call.answer}")
    text = "\n".join(lines)
    if len(text) > max_chars:
        half = max_chars // 2
        text = f"{text[:half]}\n[... {len(text) - 2 * half} characters left out ...]\n{text[-half:]}"
    return text
