"""Turn what vLLM returned into ``CompletionRecord`` values, one per choice, token ids not strings.

On the request path a non-streamed body only has the parts the gateway asked for on its own behalf
set back to ``null`` for the client (``strip.client_body``); streamed chunks are collected per choice
(``StreamCapture``). Splitting the
body per choice, decoding the token-level parts, building arrays and encoding happen in the producer
(``encode_call_records``), so the event loop does no per-token work beyond what forwarding needs.
"""

from __future__ import annotations

import operator
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any

import msgspec
import numpy as np
import orjson

from streamrl.broker.schema import CompletionRecord, encode
from streamrl.engine.wire import WireError, decode_capture
from streamrl.gateway.wire import CHAT, COMPLETIONS, ENDPOINTS


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
    request_id: str = field(default_factory=lambda: os.urandom(16).hex())
    started: float = field(default_factory=time.perf_counter)
    created: float = field(default_factory=time.time)
    purpose: str = "train"
    """``train``, or ``eval`` (``X-Streamrl-Purpose``): recorded, never trained on."""
    key_id: str | None = None
    """The id of the call's API key (``auth.py``), never the key."""


@dataclass(slots=True)
class ChoiceCapture:
    """The raw pieces of one choice as they came from vLLM (lists, not yet arrays)."""

    index: int
    prompt_token_ids: list[int] | np.ndarray | None = None
    token_ids: list[int] | np.ndarray = field(default_factory=list)
    logprobs: list[Any] | np.ndarray = field(default_factory=list)
    """From JSON, chat: ``logprobs.content`` entries (dicts), completions: ``token_logprobs`` floats; from
    the engine's capture: a float32 array."""
    text: list[str] = field(default_factory=list)
    tool_calls: dict[int, dict[str, Any]] | list[dict[str, Any]] | None = None
    finish_reason: str | None = None
    first_token_s: float | None = None
    version_spans: list[tuple[int, int]] | None = None
    """Where the engine moved the choice to a newer adapter version (capture format 2), else None."""


_Field = msgspec.Raw | msgspec.UnsetType
_Top = msgspec.defstruct(
    "_Top", [(k, list[dict[str, msgspec.Raw]] | msgspec.UnsetType if k == "choices" else _Field, msgspec.UNSET)
             for k in dict.fromkeys(CHAT.top_keys + COMPLETIONS.top_keys)],
    forbid_unknown_fields=True, omit_defaults=True)
"""The top-level keys of vLLM's chat and completions responses, in its order; absent ones stay absent."""

_KNOWN_TOP = msgspec.json.Decoder(_Top)
_TOP = msgspec.json.Decoder(dict[str, msgspec.Raw])
_CHOICES = msgspec.json.Decoder(list[dict[str, msgspec.Raw]])
_IDS = msgspec.json.Decoder(list[int] | None)
_ANY = msgspec.json.Decoder()
_ENCODER = msgspec.json.Encoder()
NULL = msgspec.Raw(b"null")


@dataclass(slots=True)
class RawChoice:
    """One choice of a non-streamed body, its parts still as undecoded JSON (``msgspec.Raw``)."""

    fields: dict[str, msgspec.Raw]
    prompt_token_ids: msgspec.Raw | None


def split_body(raw: bytes, endpoint: str, strip_ids: bool,
               strip_logprobs: bool) -> tuple[bytes, list[RawChoice], msgspec.Raw | None]:
    """One shallow pass over a non-streamed body: the per-choice parts the record needs, kept undecoded
    (the producer splits the body this way, then decodes the 1,000 logprobs), and the body for the client
    with what the gateway asked for on its own behalf set back to ``null`` (the request path's fallback
    when ``fast_strip`` cannot be used). Unchanged bytes when nothing is stripped."""
    at_top = not ENDPOINTS[endpoint].prompt_ids_per_choice  # chat: the prompt's ids once, at the top
    try:  # one pass when every top-level key is one vLLM is known to send
        known = _KNOWN_TOP.decode(raw)
        choices = known.choices if known.choices is not msgspec.UNSET else []
        top_prompt = known.prompt_token_ids if at_top and known.prompt_token_ids is not msgspec.UNSET else None
        usage = known.usage if known.usage is not msgspec.UNSET else None
        top: _Top | dict[str, msgspec.Raw] = known
    except msgspec.ValidationError:  # a key this code does not know: keep it, at the cost of two passes
        top = _TOP.decode(raw)
        choices = _CHOICES.decode(top["choices"]) if "choices" in top else []
        top_prompt = top.get("prompt_token_ids") if at_top else None
        usage = top.get("usage")
    captured = [RawChoice(dict(c), top_prompt if at_top else c.get("prompt_token_ids")) for c in choices]
    if not (strip_ids or strip_logprobs):
        return raw, captured, usage
    if strip_ids and at_top and top_prompt is not None:
        if isinstance(top, dict):
            top["prompt_token_ids"] = NULL
        else:
            top.prompt_token_ids = NULL
    for c in choices:
        if strip_ids:
            if "token_ids" in c:
                c["token_ids"] = NULL
            if not at_top and "prompt_token_ids" in c:
                c["prompt_token_ids"] = NULL
        if strip_logprobs and "logprobs" in c:
            c["logprobs"] = NULL
    if isinstance(top, dict):
        top["choices"] = choices  # type: ignore[assignment]
    return _ENCODER.encode(top), captured, usage


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


_USAGE = msgspec.json.Decoder(_Usage | None)


def usage_tokens(usage: msgspec.Raw | None) -> tuple[int, int]:
    """(prompt, completion) token counts of a response's usage, for metrics."""
    try:
        u = _USAGE.decode(usage) if usage is not None else None
    except msgspec.MsgspecError:
        return 0, 0
    return (u.prompt_tokens, u.completion_tokens) if u is not None else (0, 0)


def decode_choice(choice: RawChoice, endpoint: str) -> ChoiceCapture:
    """The producer's half of ``split_body``: decode what the record needs, typed and lean."""
    e = ENDPOINTS[endpoint]
    f = choice.fields
    token_ids = (_IDS.decode(f["token_ids"]) if "token_ids" in f else None) or []
    logprobs = e.decode_logprobs(f["logprobs"]) if "logprobs" in f else []
    text, tool_calls = e.decode_output(f)
    if len(logprobs) > len(token_ids):  # completions with echo: the prompt's logprobs come first
        logprobs = logprobs[len(logprobs) - len(token_ids):]
    return ChoiceCapture(
        index=_ANY.decode(f["index"]) if "index" in f else 0,
        prompt_token_ids=_IDS.decode(choice.prompt_token_ids) if choice.prompt_token_ids is not None else None,
        token_ids=token_ids, logprobs=logprobs, text=[text], tool_calls=tool_calls,
        finish_reason=_ANY.decode(f["finish_reason"]) if "finish_reason" in f else None,
    )


class StreamCapture:
    """Accumulates streamed chunks per choice index."""

    __slots__ = ("choices", "endpoint", "prompt_token_ids")

    def __init__(self, endpoint: str) -> None:
        self.endpoint = ENDPOINTS[endpoint]
        self.choices: dict[int, ChoiceCapture] = {}
        self.prompt_token_ids: list[int] | None = None

    def add(self, chunk: dict[str, Any], now: float) -> None:
        per_choice = self.endpoint.prompt_ids_per_choice
        if not per_choice and chunk.get("prompt_token_ids") is not None:
            self.prompt_token_ids = chunk["prompt_token_ids"]
        for choice in chunk.get("choices") or ():
            index = choice.get("index", 0)
            c = self.choices.get(index)
            if c is None:
                c = self.choices[index] = ChoiceCapture(index=index, prompt_token_ids=None)
            ids = choice.get("token_ids")
            if ids:
                c.token_ids.extend(ids)
            text, tool_calls, logprobs = self.endpoint.chunk_output(choice)
            if logprobs:
                c.logprobs.extend(logprobs)
            if text:
                c.text.append(text)
            if tool_calls:
                _merge_tool_call_deltas(c, tool_calls)
            if c.first_token_s is None and (ids or text or tool_calls):  # the first chunk with generated tokens
                c.first_token_s = now
            if per_choice and choice.get("prompt_token_ids") is not None:
                c.prompt_token_ids = choice["prompt_token_ids"]
            if choice.get("finish_reason") is not None:
                c.finish_reason = choice["finish_reason"]

    def captures(self) -> list[ChoiceCapture]:
        out = []
        for index in sorted(self.choices):
            c = self.choices[index]
            if not self.endpoint.prompt_ids_per_choice:
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
        logprobs = c.logprobs
        if isinstance(logprobs, list):  # from JSON: chat entries are dicts, completions floats or null
            if logprobs and isinstance(logprobs[0], dict):
                logprobs = [e["logprob"] for e in logprobs]
            if any(x is None for x in logprobs):
                raise CaptureError(f"choice {c.index}: a sampled token has no logprob")
        if len(logprobs) != len(c.token_ids):
            raise CaptureError(f"choice {c.index}: {len(c.token_ids)} token ids but {len(logprobs)} logprobs")
        records.append(CompletionRecord(
            request_id=ctx.request_id, trajectory_id=ctx.trajectory_id, group_id=ctx.group_id,
            prompt_token_ids=c.prompt_token_ids, completion_token_ids=c.token_ids, logprobs=logprobs,
            choice_index=c.index, model=ctx.model, policy_name=ctx.policy_name,
            policy_version=ctx.policy_version, upstream=ctx.upstream, endpoint=ctx.endpoint,
            version_spans=_moved_spans(c.version_spans, ctx.policy_version),
            finish_reason=c.finish_reason,
            ttft_s=None if c.first_token_s is None else c.first_token_s - ctx.started,
            total_s=total_s,
            usage={"prompt_tokens": len(c.prompt_token_ids), "completion_tokens": len(c.token_ids)},
            request=ctx.request, response_text="".join(c.text), tool_calls=c.tool_calls or None,
            created=ctx.created, purpose=ctx.purpose, key_id=ctx.key_id,
        ))
    return records


def _moved_spans(spans: list[tuple[int, int]] | None, routed: int) -> list[tuple[int, int]] | None:
    """A choice's version spans for its record: None when it ran on the version it was routed to throughout."""
    if not spans or spans == [(0, routed)]:
        return None
    return [(int(first), int(version)) for first, version in spans]


def encode_call_records(ctx: CallContext, choices: list[ChoiceCapture] | bytes,
                        total_s: float) -> list[tuple[bytes | None, bytes]]:
    """The producer's job for one call (module-level, so it can be sent to a producer process): split a
    non-streamed body (the bytes vLLM sent) and decode its choices, or take a stream's captured ones;
    build and encode every choice's record, keyed by trajectory id."""
    captures = choices if not isinstance(choices, bytes) else [
        decode_choice(c, ctx.endpoint) for c in split_body(choices, ctx.endpoint, False, False)[1]]
    key = ctx.trajectory_id.encode()
    return [(key, encode(r)) for r in build_records(ctx, captures, total_s)]


def sse_chunks(data: bytes) -> Iterator[dict[str, Any]]:
    """The JSON objects of complete ``data:`` events (``[DONE]`` and comments skipped); ``CaptureError`` on an
    event that is not JSON or is vLLM's mid-stream error (the call then has no record)."""
    for event in data.split(b"\n\n"):
        if not event.startswith(b"data: ") or event == b"data: [DONE]":
            continue
        try:
            chunk = orjson.loads(event[6:])
        except orjson.JSONDecodeError:
            raise CaptureError("a stream event is not JSON") from None
        if not isinstance(chunk, dict) or "error" in chunk:
            raise CaptureError("the stream carried an error")
        yield chunk


_CONTEXT_FIELDS = tuple(f.name for f in fields(CallContext))
_context_values = operator.attrgetter(*_CONTEXT_FIELDS)
"""A call's context as a tuple of its fields' values: orjson writes that in a quarter of the time it takes
for the dataclass (0.6 against 2.0 us, most of ``engine_parts`` on the event loop). Both ends are the same
code (the gateway and the record producer it starts), so the order is the class's."""


def engine_parts(ctx: CallContext, total_s: float) -> bytes:
    """The call's context as the first part of ``encode_engine_parts``: its fields' values as a JSON array, a
    fraction of a pickle's cost on the event loop."""
    return orjson.dumps((_context_values(ctx), total_s))


def encode_engine_parts(context: bytes, body: bytes, capture: bytes) -> list[tuple[bytes | None, bytes]]:
    """``encode_engine_records`` of a non-streamed call handed over as byte strings (``LogProducer.offer_parts``):
    the context from ``engine_parts``, vLLM's body and the capture."""
    values, total_s = orjson.loads(context)
    return encode_engine_records(CallContext(**dict(zip(_CONTEXT_FIELDS, values, strict=True))), body, capture,
                                 total_s)


def encode_engine_records(ctx: CallContext, body: bytes | list[tuple[float, bytes]], capture: bytes | None,
                          total_s: float) -> list[tuple[bytes | None, bytes]]:
    """The producer's job for one call served by ``streamrl engine`` (``engine/wire.py``): token ids
    and logprobs from the engine's capture, text, tool calls and finish reason from what the client got
    (a non-streamed body, or a stream's event bytes with their arrival times)."""
    if capture is None:
        raise CaptureError("the engine sent no capture (a choice did not finish, or it could not encode it)")
    try:
        tokens = decode_capture(capture)
    except WireError as exc:
        raise CaptureError(str(exc)) from None
    if isinstance(body, bytes):
        texts = {c.index: c for c in (decode_choice(r, ctx.endpoint) for r in split_body(body, ctx.endpoint,
                                                                                         False, False)[1])}
    else:
        stream = StreamCapture(ctx.endpoint)
        for now, data in body:
            for chunk in sse_chunks(data):
                stream.add(chunk, now)
        texts = {c.index: c for c in stream.captures()}
    if sorted(texts) != sorted(t.index for t in tokens):
        raise CaptureError(f"choices {sorted(texts)} in the response but {[t.index for t in tokens]} captured")
    captures = []
    for t in sorted(tokens, key=lambda t: t.index):
        c = texts[t.index]
        c.prompt_token_ids, c.token_ids, c.logprobs = t.prompt_token_ids, t.token_ids, t.logprobs
        c.version_spans = t.version_spans
        captures.append(c)
    key = ctx.trajectory_id.encode()
    return [(key, encode(r)) for r in build_records(ctx, captures, total_s)]


RECORD_BUILDERS = (encode_engine_parts,)
"""What the gateway hands its log producer as parts (``LogProducer(builders=...)``): the producer process
builds records only with these."""
