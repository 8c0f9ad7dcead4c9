"""The client's copy of a non-streamed vLLM body: what the gateway asked for on its own behalf (token
ids, logprobs) set back to ``null``, found with ``bytes.find`` on vLLM's compact JSON instead of a JSON
pass over the whole (mostly logprobs) body; ``capture.split_body``'s msgspec pass is the fallback
whenever the body is not in the shape this module knows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from .recording.capture import NULL, split_body
from .wire import ENDPOINTS, Endpoint


class _Usage(msgspec.Struct):
    completion_tokens: int = 0


_TOP = msgspec.json.Decoder(dict[str, msgspec.Raw])
_CHOICES = msgspec.json.Decoder(list[dict[str, msgspec.Raw]])
_USAGE = msgspec.json.Decoder(_Usage | None)

_LOGPROBS, _FINISH = b'"logprobs":', b'"finish_reason":'
_TOKEN_IDS, _PROMPT_IDS = b'"token_ids":', b'"prompt_token_ids":'
_NUMBER = frozenset(b"-0123456789")


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


def fast_strip(raw: bytes, endpoint: str, strip_ids: bool, strip_logprobs: bool,
               one_choice: bool = False) -> tuple[bytes, int, msgspec.Raw | None] | str:
    """``(client body, number of choices, usage)`` found with ``bytes.find`` instead of a JSON pass over the
    whole (mostly logprobs) body, or why not (a string): the caller then takes the msgspec path.

    Relies on vLLM's compact JSON and its field order. Each choice has one ``logprobs`` key; one forward
    search finds the next choice's, and this choice's other keys are searched only before it: its
    ``logprobs`` value ends where its (last) ``,"finish_reason":`` begins, then come ``token_ids`` (ints up
    to the first ``]``) and, for completions, ``prompt_token_ids``. Each stripped value is replaced by
    ``null``; the result (small) is then parsed to check every assumption: valid JSON, known keys in vLLM's
    order, one choice per ``logprobs`` key, every stripped field ``null``, the token ids found adding up to
    the usage's completion tokens.

    ``one_choice``: the request asked for one choice (chat, ``n`` = 1), so there is no next choice's
    ``logprobs`` key to look for: that forward search is the one pass over the whole ~100 KB of logprobs,
    which dominates the strip's time. The check then also requires exactly one
    choice back; what it cannot see is a second choice with no tokens at all, which vLLM never sends."""
    e = ENDPOINTS[endpoint]
    per_choice = e.prompt_ids_per_choice
    if not (raw.startswith(b'{"id":"') and raw.endswith(b"}")):
        return "not compact vLLM JSON"
    size = len(raw)
    spans: list[tuple[int, int]] = []
    choices = tokens = pos = 0
    lp = _value_at(raw, _LOGPROBS, 0, size, b"{n")
    while lp >= 0:
        # the one pass over this choice's logprobs, unless the request asked for one choice
        nxt = _NOT_FOUND if one_choice else _value_at(raw, _LOGPROBS, lp, size, b"{n")
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
            if not e.logprobs_shape(raw, lp, lp_end):
                return f"choice {choices}: logprobs not of the expected shape"
            spans.append((lp, lp_end))
        v = _value_at(raw, _TOKEN_IDS, fr, end, b"[")  # always there when recording: the gateway asks for them
        pos = _ids_end(raw, v, end) if v >= 0 else -1
        if pos < 0:
            return f"choice {choices}: no list of token ids after finish_reason"
        tokens += raw.count(b",", v, pos) + 1 if pos - v > 2 else 0
        if strip_ids:
            spans.append((v, pos))
            if per_choice:
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
    if strip_ids and not per_choice:
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
    return _checked(body, e, choices, tokens, strip_ids, strip_logprobs, top_ids)


def _checked(body: bytes, e: Endpoint, choices: int, tokens: int, strip_ids: bool, strip_logprobs: bool,
             top_ids: bool) -> tuple[bytes, int, msgspec.Raw | None] | str:
    """The fast path's result when the stripped body is what the msgspec path would have produced."""
    try:
        top = _TOP.decode(body)
        parsed = _CHOICES.decode(top["choices"]) if "choices" in top else []
        usage = _USAGE.decode(top["usage"]) if "usage" in top else None
    except msgspec.MsgspecError as exc:
        return f"stripped body does not parse: {exc}"
    if not _in_order(top, e.top_keys):
        return "top-level keys unknown or not in vLLM's order"
    if len(parsed) != choices:
        return f"{len(parsed)} choices but {choices} found"
    if usage is None or usage.completion_tokens != tokens:
        return f"usage does not count the {tokens} token ids found"
    if top_ids and "prompt_token_ids" not in top:
        return "prompt_token_ids found below the top level"
    if strip_ids and not e.prompt_ids_per_choice and top.get("prompt_token_ids", NULL) != NULL:
        return "top-level prompt_token_ids not stripped"
    stripped = e.stripped_choice_keys(strip_ids, strip_logprobs)
    for c in parsed:
        if not _in_order(c, e.choice_keys) or "logprobs" not in c or "finish_reason" not in c:
            return "choice keys unknown or not in vLLM's order"
        if any(c.get(k) != NULL for k in stripped):
            return "a stripped field is not null"
    return body, choices, top["usage"]


class _Shape(msgspec.Struct):
    choices: list[msgspec.Raw] = []
    usage: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET


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


def client_body(raw: bytes, endpoint: str, strip_ids: bool, strip_logprobs: bool,
                one_choice: bool = False) -> ClientBody:
    """The client's body, the number of choices and the usage of a non-streamed vLLM body; raises
    ``msgspec.MsgspecError`` when it is not such a body. Byte-level when it can be, else ``split_body``.
    ``one_choice``: the request asked for exactly one choice (see ``fast_strip``)."""
    if not (strip_ids or strip_logprobs):
        shape = _SHAPE.decode(raw)
        return ClientBody(raw, len(shape.choices), None if shape.usage is msgspec.UNSET else shape.usage)
    fast = fast_strip(raw, endpoint, strip_ids, strip_logprobs, one_choice)
    if not isinstance(fast, str):
        return ClientBody(*fast)
    body, captured, usage = split_body(raw, endpoint, strip_ids, strip_logprobs)
    return ClientBody(body, len(captured), usage, fallback=fast)
