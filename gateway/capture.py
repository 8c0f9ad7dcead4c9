"""Turn what vLLM returned into ``CompletionRecord`` values, one per choice, token ids not strings.

On the request path a non-streamed body only has the parts the gateway asked for on its own behalf
set back to ``null`` for the client (``client_body``: byte-level on vLLM's compact JSON, one shallow
msgspec pass otherwise); streamed chunks are collected per choice (``StreamCapture``). Splitting the
body per choice, decoding the token-level parts, building arrays and encoding happen in the producer
(``encode_call_records``), so the event loop does no per-token work beyond what forwarding needs.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from streamrl.broker.schema import CompletionRecord, encode


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


class _Logprob(msgspec.Struct):
    logprob: float | None = None


class _ChatLogprobs(msgspec.Struct):
    content: list[_Logprob] | None = None


class _CompletionLogprobs(msgspec.Struct):
    token_logprobs: list[float | None] | None = None


_Field = msgspec.Raw | msgspec.UnsetType


class _Top(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """The top-level keys of vLLM's chat and completions responses, in its order; absent ones stay absent."""

    id: _Field = msgspec.UNSET
    object: _Field = msgspec.UNSET
    created: _Field = msgspec.UNSET
    model: _Field = msgspec.UNSET
    choices: list[dict[str, msgspec.Raw]] | msgspec.UnsetType = msgspec.UNSET
    service_tier: _Field = msgspec.UNSET
    system_fingerprint: _Field = msgspec.UNSET
    usage: _Field = msgspec.UNSET
    prompt_logprobs: _Field = msgspec.UNSET
    prompt_token_ids: _Field = msgspec.UNSET
    prompt_text: _Field = msgspec.UNSET
    kv_transfer_params: _Field = msgspec.UNSET
    ec_transfer_params: _Field = msgspec.UNSET
    metrics: _Field = msgspec.UNSET


_KNOWN_TOP = msgspec.json.Decoder(_Top)
_TOP = msgspec.json.Decoder(dict[str, msgspec.Raw])
_CHOICES = msgspec.json.Decoder(list[dict[str, msgspec.Raw]])
_IDS = msgspec.json.Decoder(list[int] | None)
_CHAT_LP = msgspec.json.Decoder(_ChatLogprobs | None)
_COMPLETION_LP = msgspec.json.Decoder(_CompletionLogprobs | None)
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
    chat = endpoint == "chat"
    try:  # one pass when every top-level key is one vLLM is known to send
        known = _KNOWN_TOP.decode(raw)
        choices = known.choices if known.choices is not msgspec.UNSET else []
        top_prompt = known.prompt_token_ids if chat and known.prompt_token_ids is not msgspec.UNSET else None
        usage = known.usage if known.usage is not msgspec.UNSET else None
        top: _Top | dict[str, msgspec.Raw] = known
    except msgspec.ValidationError:  # a key this code does not know: keep it, at the cost of two passes
        top = _TOP.decode(raw)
        choices = _CHOICES.decode(top["choices"]) if "choices" in top else []
        top_prompt = top.get("prompt_token_ids") if chat else None
        usage = top.get("usage")
    captured = [RawChoice(dict(c), top_prompt if chat else c.get("prompt_token_ids")) for c in choices]
    if not (strip_ids or strip_logprobs):
        return raw, captured, usage
    if strip_ids and chat and top_prompt is not None:
        if isinstance(top, dict):
            top["prompt_token_ids"] = NULL
        else:
            top.prompt_token_ids = NULL
    for c in choices:
        if strip_ids:
            if "token_ids" in c:
                c["token_ids"] = NULL
            if not chat and "prompt_token_ids" in c:
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


# -- the client's body: a byte-level strip for vLLM's own JSON, the msgspec pass as the fallback ----------

_CHAT_TOP = ("id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage",
             "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params", "ec_transfer_params",
             "metrics")
_COMPLETION_TOP = ("id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage",
                   "kv_transfer_params", "ec_transfer_params", "metrics")
_CHAT_CHOICE = ("index", "message", "logprobs", "finish_reason", "stop_reason", "token_ids", "routed_experts")
_COMPLETION_CHOICE = ("index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids", "prompt_logprobs",
                      "prompt_token_ids", "routed_experts")
"""vLLM's field order (its pydantic response models, serialised compactly by ``model_dump`` + starlette's
``JSONResponse``); absent keys are allowed, others or another order send a body to the msgspec path."""

_LOGPROBS, _FINISH = b'"logprobs":', b'"finish_reason":'
_TOKEN_IDS, _PROMPT_IDS = b'"token_ids":', b'"prompt_token_ids":'
_NUMBER = frozenset(b"-0123456789")
_DIGITS = frozenset(b"0123456789")


def _logprobs_shape(raw: bytes, start: int, end: int, chat: bool) -> bool:
    """Whether ``raw[start:end]`` begins and ends as the logprobs the gateway asks for do (chat: no
    ``top_logprobs``; completions: ``logprobs=0``, one ``{token: logprob}`` per token). Not a parse: it
    catches a key that another vLLM version would put between ``logprobs`` and ``finish_reason`` unless that
    key's value ends exactly like a logprobs value (``test_field_order_is_vllms`` pins the installed order)."""
    if chat:
        if raw.startswith(b'{"content":[{"token":"', start):
            return raw.endswith((b'],"top_logprobs":[]}]}', b'null,"top_logprobs":[]}]}'), start, end)
        return raw[start:end] in (b'{"content":null}', b'{"content":[]}')
    if not raw.startswith(b'{"text_offset":[', start):
        return False
    return ((raw.endswith(b"}]}", start, end) and raw[end - 4] in _DIGITS)
            or raw.endswith((b"null]}", b'"top_logprobs":[]}'), start, end))


_NOT_FOUND, _UNEXPECTED = -1, -2


def _value_at(raw: bytes, key: bytes, start: int, end: int, firsts: bytes, last: bool = False) -> int:
    """Where the value of the first (``last``: the last) key ``key`` (``"name":``) in ``raw[start:end]``
    begins, if the key follows a comma and its value starts with one of ``firsts``; else ``_NOT_FOUND``,
    or ``_UNEXPECTED`` for the same key elsewhere (first in its object, after whitespace) or another value.

    In compact JSON a ``"name":`` preceded by a comma (or ``{``) is always a key: inside a string every
    ``"`` is escaped, so only a backslash can come before a quote there, and those matches are skipped.
    Keys with a number as value are skipped too: in a completion's ``top_logprobs`` the token strings are
    dict keys, and any token can be spelt ``finish_reason``."""
    while True:
        i = raw.rfind(key, start, end) if last else raw.find(key, start, end)
        if i < 0:
            return _NOT_FOUND
        v = i + len(key)
        if v >= len(raw) or i == 0:
            return _UNEXPECTED
        if raw[i - 1] != 92 and raw[v] not in _NUMBER:  # 92: a backslash
            return v if raw[i - 1] == 44 and raw[v] in firsts else _UNEXPECTED  # 44: a comma
        if last:
            end = i
        else:
            start = v


def _ids_end(raw: bytes, v: int, end: int) -> int:
    """End of the int list at ``v`` (after its ``]``, before ``end``), or -1 if it holds anything but digits
    and commas."""
    e = raw.find(b"]", v, end)
    if e < 0 or raw[v + 1:e].translate(None, b"0123456789,"):
        return -1
    return e + 1


def _in_order(keys: Any, order: tuple[str, ...]) -> bool:
    """Every key is one of ``order`` and they come in that order (some may be absent)."""
    it = iter(order)
    return all(k in it for k in keys)


def fast_strip(raw: bytes, endpoint: str, strip_ids: bool,
               strip_logprobs: bool) -> tuple[bytes, int, msgspec.Raw | None] | str:
    """``(client body, number of choices, usage)`` found with ``bytes.find`` instead of a JSON pass over the
    whole (mostly logprobs) body, or why not (a string): the caller then takes the msgspec path.

    Relies on vLLM's compact JSON and its field order. Each choice has one ``logprobs`` key; one forward
    search finds the next choice's, and this choice's other keys are searched only before it: its
    ``logprobs`` value ends where its (last) ``,"finish_reason":`` begins, then come ``token_ids`` (ints up
    to the first ``]``) and, for completions, ``prompt_token_ids``. Each stripped value is replaced by
    ``null``; the result (small) is then parsed to check every assumption: valid JSON, known keys in vLLM's
    order, one choice per ``logprobs`` key, every stripped field ``null``, the token ids found adding up to
    the usage's completion tokens."""
    chat = endpoint == "chat"
    if not (raw.startswith(b'{"id":"') and raw.endswith(b"}")):
        return "not compact vLLM JSON"
    size = len(raw)
    spans: list[tuple[int, int]] = []
    choices = tokens = pos = 0
    lp = _value_at(raw, _LOGPROBS, 0, size, b"{n")
    while lp >= 0:
        nxt = _value_at(raw, _LOGPROBS, lp, size, b"{n")  # the one pass over this choice's logprobs
        if nxt == _UNEXPECTED:
            return f"choice {choices + 1}: logprobs not where or as vLLM writes it"
        end = nxt - len(_LOGPROBS) if nxt >= 0 else size
        fr = _value_at(raw, _FINISH, lp, end, b'"n', last=True)
        if fr < 0:
            return f"choice {choices}: no finish_reason after logprobs"
        lp_end = fr - len(_FINISH) - 1  # before its comma
        if raw[lp] == 110:  # b"n": null
            if lp_end != lp + 4:
                return f"choice {choices}: unexpected keys after logprobs"
        elif strip_logprobs:
            if not _logprobs_shape(raw, lp, lp_end, chat):
                return f"choice {choices}: logprobs not of the expected shape"
            spans.append((lp, lp_end))
        v = _value_at(raw, _TOKEN_IDS, fr, end, b"[")  # always there when recording: the gateway asks for them
        pos = _ids_end(raw, v, end) if v >= 0 else -1
        if pos < 0:
            return f"choice {choices}: no list of token ids after finish_reason"
        tokens += raw.count(b",", v, pos) + 1 if pos - v > 2 else 0
        if strip_ids:
            spans.append((v, pos))
            if not chat:
                v = _value_at(raw, _PROMPT_IDS, pos, end, b"[n")
                if v < 0:
                    return f"choice {choices}: no prompt_token_ids after token_ids"
                if raw[v] == 91:  # b"["
                    pos = _ids_end(raw, v, end)
                    if pos < 0:
                        return f"choice {choices}: prompt_token_ids is not a list of ints"
                    spans.append((v, pos))
        choices += 1
        lp = nxt
    if lp == _UNEXPECTED:
        return "choice 0: logprobs not where or as vLLM writes it"
    if not choices:
        return "no choices found"
    top_ids = False
    if strip_ids and chat:
        v = _value_at(raw, _PROMPT_IDS, pos, size, b"[n")
        if v == _UNEXPECTED:
            return "top-level prompt_token_ids not a list"
        if v >= 0 and raw[v] == 91:
            end = _ids_end(raw, v, size)
            if end < 0:
                return "top-level prompt_token_ids is not a list of ints"
            spans.append((v, end))
            top_ids = True
    if spans:
        parts, prev = [], 0
        for start, stop in spans:
            parts += (raw[prev:start], b"null")
            prev = stop
        parts.append(raw[prev:])
        body = b"".join(parts)
    else:
        body = raw
    return _checked(body, chat, choices, tokens, strip_ids, strip_logprobs, top_ids)


def _checked(body: bytes, chat: bool, choices: int, tokens: int, strip_ids: bool, strip_logprobs: bool,
             top_ids: bool) -> tuple[bytes, int, msgspec.Raw | None] | str:
    """The fast path's result when the stripped body is what the msgspec path would have produced."""
    try:
        top = _TOP.decode(body)
        parsed = _CHOICES.decode(top["choices"]) if "choices" in top else []
        usage = _USAGE.decode(top["usage"]) if "usage" in top else None
    except msgspec.MsgspecError as exc:
        return f"stripped body does not parse: {exc}"
    if not _in_order(top, _CHAT_TOP if chat else _COMPLETION_TOP):
        return "top-level keys unknown or not in vLLM's order"
    if len(parsed) != choices:
        return f"{len(parsed)} choices but {choices} found"
    if usage is None or usage.completion_tokens != tokens:
        return f"usage does not count the {tokens} token ids found"
    if top_ids and "prompt_token_ids" not in top:
        return "prompt_token_ids found below the top level"
    if strip_ids and chat and top.get("prompt_token_ids", NULL) != NULL:
        return "top-level prompt_token_ids not stripped"
    order = _CHAT_CHOICE if chat else _COMPLETION_CHOICE
    stripped = ((("logprobs",) if strip_logprobs else ())
                + ((("token_ids",) if chat else ("token_ids", "prompt_token_ids")) if strip_ids else ()))
    for c in parsed:
        if not _in_order(c, order) or "logprobs" not in c or "finish_reason" not in c:
            return "choice keys unknown or not in vLLM's order"
        if any(c.get(k) != NULL for k in stripped):
            return "a stripped field is not null"
    return body, choices, top["usage"]


class _Shape(msgspec.Struct):
    choices: list[msgspec.Raw] = []
    usage: _Field = msgspec.UNSET


_SHAPE = msgspec.json.Decoder(_Shape)


@dataclass(slots=True)
class ClientBody:
    """What the request path needs of a non-streamed body."""

    body: bytes
    """For the client: what the gateway asked for on its own behalf set back to ``null``."""
    choices: int
    """How many records the body makes."""
    usage: msgspec.Raw | None
    fallback: str | None = None
    """Why the byte-level strip was not used (``None`` when it was, or when nothing was stripped)."""


def client_body(raw: bytes, endpoint: str, strip_ids: bool, strip_logprobs: bool) -> ClientBody:
    """The client's body, the number of choices and the usage of a non-streamed vLLM body; raises
    ``msgspec.MsgspecError`` when it is not such a body. Byte-level when it can be, else ``split_body``."""
    if not (strip_ids or strip_logprobs):
        shape = _SHAPE.decode(raw)
        return ClientBody(raw, len(shape.choices), None if shape.usage is msgspec.UNSET else shape.usage)
    fast = fast_strip(raw, endpoint, strip_ids, strip_logprobs)
    if not isinstance(fast, str):
        return ClientBody(*fast)
    body, captured, usage = split_body(raw, endpoint, strip_ids, strip_logprobs)
    return ClientBody(body, len(captured), usage, fallback=fast)


def usage_tokens(usage: msgspec.Raw | None) -> tuple[int, int]:
    """(prompt, completion) token counts of a response's usage, for metrics."""
    try:
        u = _USAGE.decode(usage) if usage is not None else None
    except msgspec.MsgspecError:
        return 0, 0
    return (u.prompt_tokens, u.completion_tokens) if u is not None else (0, 0)


def decode_choice(choice: RawChoice, endpoint: str) -> ChoiceCapture:
    """The producer's half of ``split_body``: decode what the record needs, typed and lean."""
    f = choice.fields
    token_ids = _IDS.decode(f["token_ids"]) if "token_ids" in f else None
    if endpoint == "chat":
        lp = _CHAT_LP.decode(f["logprobs"]) if "logprobs" in f else None
        logprobs = [e.logprob for e in lp.content] if lp is not None and lp.content else []
        message = _ANY.decode(f["message"]) if "message" in f else {}
        text = (message or {}).get("content") or ""
        tool_calls = (message or {}).get("tool_calls") or None
    else:
        lp = _COMPLETION_LP.decode(f["logprobs"]) if "logprobs" in f else None
        logprobs = list(lp.token_logprobs or []) if lp is not None else []
        text = _ANY.decode(f["text"]) if "text" in f else ""
        tool_calls = None
    token_ids = token_ids or []
    if len(logprobs) > len(token_ids):  # completions with echo: the prompt's logprobs come first
        logprobs = logprobs[len(logprobs) - len(token_ids):]
    return ChoiceCapture(
        index=_ANY.decode(f["index"]) if "index" in f else 0,
        prompt_token_ids=_IDS.decode(choice.prompt_token_ids) if choice.prompt_token_ids is not None else None,
        token_ids=token_ids, logprobs=logprobs, text=[text or ""], tool_calls=tool_calls,
        finish_reason=_ANY.decode(f["finish_reason"]) if "finish_reason" in f else None,
    )


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
        if any(x is None for x in logprobs):
            raise CaptureError(f"choice {c.index}: a sampled token has no logprob")
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


def encode_call_records(ctx: CallContext, choices: list[ChoiceCapture] | list[RawChoice] | bytes,
                        total_s: float) -> list[tuple[bytes | None, bytes]]:
    """The producer's job for one call (module-level, so it can be sent to a producer process): split a
    non-streamed body (the bytes vLLM sent), decode, build and encode every choice's record, keyed by
    trajectory id."""
    if isinstance(choices, bytes):
        choices = split_body(choices, ctx.endpoint, False, False)[1]
    captures = [c if isinstance(c, ChoiceCapture) else decode_choice(c, ctx.endpoint) for c in choices]
    key = ctx.trajectory_id.encode()
    return [(key, encode(r)) for r in build_records(ctx, captures, total_s)]
