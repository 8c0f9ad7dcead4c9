"""Turn what vLLM returned into ``CompletionRecord`` values, one per choice, token ids not strings.

The request path only collects references (``ChoiceCapture``); building arrays and encoding happens on
the producer thread (``build_records``), so the event loop does no per-token work beyond what
forwarding needs.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from streamrl.broker.schema import CompletionRecord


@dataclass(slots=True)
class CallContext:
    """Everything about one call that every record of it shares."""

    trajectory_id: str
    group_id: str | None
    endpoint: str
    """``chat`` or ``completions``."""
    model: str
    """The model name the client asked for."""
    policy_name: str | None
    policy_version: int
    request: dict[str, Any]
    upstream: str = ""
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    started: float = field(default_factory=time.perf_counter)
    created: float = field(default_factory=time.time)


@dataclass(slots=True)
class ChoiceCapture:
    """The raw pieces of one choice as they came from vLLM (lists, not yet arrays)."""

    index: int
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    """Chat: ``logprobs.content`` entries (dicts); completions: ``token_logprobs`` floats."""
    text: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] | list[dict[str, Any]] | None = None
    finish_reason: str | None = None
    first_token_s: float | None = None


def capture_body(data: dict[str, Any], endpoint: str) -> list[ChoiceCapture]:
    """Collect the per-choice pieces of a non-streamed response (references only, cheap)."""
    chat = endpoint == "chat"
    top_prompt = data.get("prompt_token_ids") if chat else None
    out = []
    for choice in data.get("choices") or ():
        lp = choice.get("logprobs")
        if chat:
            message = choice.get("message") or {}
            text = message.get("content") or ""
            entries = (lp or {}).get("content") or []
            tool_calls = message.get("tool_calls") or None
        else:
            text = choice.get("text") or ""
            entries = (lp or {}).get("token_logprobs") or []
            tool_calls = None
        token_ids = choice.get("token_ids") or []
        if len(entries) > len(token_ids):  # completions with echo: prompt logprobs come first
            entries = entries[len(entries) - len(token_ids):]
        out.append(ChoiceCapture(
            index=choice.get("index", 0),
            prompt_token_ids=top_prompt if chat else choice.get("prompt_token_ids"),
            token_ids=token_ids, logprobs=entries, text=[text], tool_calls=tool_calls,
            finish_reason=choice.get("finish_reason"),
        ))
    return out


class StreamCapture:
    """Accumulates streamed chunks per choice index."""

    __slots__ = ("chat", "choices", "prompt_token_ids")

    def __init__(self, endpoint: str) -> None:
        self.chat = endpoint == "chat"
        self.choices: dict[int, ChoiceCapture] = {}
        self.prompt_token_ids: list[int] | None = None

    def add(self, chunk: dict[str, Any], now: float) -> None:
        if self.chat and chunk.get("prompt_token_ids") is not None:
            self.prompt_token_ids = chunk["prompt_token_ids"]
        for choice in chunk.get("choices") or ():
            index = choice.get("index", 0)
            c = self.choices.get(index)
            if c is None:
                c = self.choices[index] = ChoiceCapture(index=index, prompt_token_ids=None)
            ids = choice.get("token_ids")
            if ids:
                if c.first_token_s is None:
                    c.first_token_s = now
                c.token_ids.extend(ids)
            lp = choice.get("logprobs")
            if self.chat:
                if lp and lp.get("content"):
                    c.logprobs.extend(lp["content"])
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    c.text.append(delta["content"])
                if delta.get("tool_calls"):
                    _merge_tool_call_deltas(c, delta["tool_calls"])
            else:
                if lp and lp.get("token_logprobs"):
                    c.logprobs.extend(lp["token_logprobs"])
                if choice.get("text"):
                    c.text.append(choice["text"])
                if choice.get("prompt_token_ids") is not None:
                    c.prompt_token_ids = choice["prompt_token_ids"]
            if choice.get("finish_reason") is not None:
                c.finish_reason = choice["finish_reason"]

    def captures(self) -> list[ChoiceCapture]:
        out = []
        for index in sorted(self.choices):
            c = self.choices[index]
            if self.chat:
                c.prompt_token_ids = self.prompt_token_ids
            if isinstance(c.tool_calls, dict):
                c.tool_calls = [c.tool_calls[i] for i in sorted(c.tool_calls)]
            if len(c.logprobs) > len(c.token_ids):  # echo: prompt logprobs first
                c.logprobs = c.logprobs[len(c.logprobs) - len(c.token_ids):]
            out.append(c)
        return out


def _merge_tool_call_deltas(c: ChoiceCapture, deltas: list[dict[str, Any]]) -> None:
    calls = c.tool_calls if isinstance(c.tool_calls, dict) else {}
    c.tool_calls = calls
    for d in deltas:
        call = calls.setdefault(d.get("index", 0), {"id": None, "type": "function",
                                                    "function": {"name": "", "arguments": ""}})
        if d.get("id"):
            call["id"] = d["id"]
        fn = d.get("function") or {}
        if fn.get("name"):
            call["function"]["name"] += fn["name"]
        if fn.get("arguments"):
            call["function"]["arguments"] += fn["arguments"]


class CaptureError(ValueError):
    """vLLM's answer lacks what a record needs (e.g. logprobs and token ids disagree)."""


def build_records(ctx: CallContext, captures: list[ChoiceCapture], total_s: float) -> list[CompletionRecord]:
    """Arrays and records, all or nothing: a choice that cannot be recorded exactly fails the call's
    records (counted by the producer) rather than writing a half-true one."""
    records = []
    for c in captures:
        if c.prompt_token_ids is None:
            raise CaptureError(f"choice {c.index}: no prompt token ids")
        logprobs = [e["logprob"] for e in c.logprobs] if c.logprobs and isinstance(c.logprobs[0], dict) \
            else c.logprobs
        if len(logprobs) != len(c.token_ids):
            raise CaptureError(f"choice {c.index}: {len(c.token_ids)} token ids but {len(logprobs)} logprobs")
        records.append(CompletionRecord(
            request_id=ctx.request_id, trajectory_id=ctx.trajectory_id, group_id=ctx.group_id,
            prompt_token_ids=c.prompt_token_ids, completion_token_ids=c.token_ids, logprobs=logprobs,
            choice_index=c.index, model=ctx.model, policy_name=ctx.policy_name,
            policy_version=ctx.policy_version, upstream=ctx.upstream, endpoint=ctx.endpoint,
            finish_reason=c.finish_reason,
            ttft_s=None if c.first_token_s is None else c.first_token_s - ctx.started,
            total_s=total_s,
            usage={"prompt_tokens": len(c.prompt_token_ids), "completion_tokens": len(c.token_ids)},
            request=ctx.request, response_text="".join(c.text), tool_calls=c.tool_calls or None,
            created=ctx.created,
        ))
    return records
