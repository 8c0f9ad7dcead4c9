"""The OpenAI wire format as vLLM speaks it, one object per endpoint: what a request must carry, what the
gateway asks for on its own behalf when it reads tokens from the JSON (a plain vLLM upstream), where
the token-level fields of a response and of a stream chunk are, and how a choice's text is read.

``proxy.py`` (requests, stream chunks), ``strip.py`` (the client's copy of a body) and ``capture.py``
(bodies and chunks -> records) hold the algorithms; what differs between chat and completions is here.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

_ANY = msgspec.json.Decoder()


class _Logprob(msgspec.Struct):
    logprob: float | None = None


class _ChatLogprobs(msgspec.Struct):
    content: list[_Logprob] | None = None


class _CompletionLogprobs(msgspec.Struct):
    token_logprobs: list[float | None] | None = None


_CHAT_LP = msgspec.json.Decoder(_ChatLogprobs | None)
_COMPLETION_LP = msgspec.json.Decoder(_CompletionLogprobs | None)

class Endpoint:
    """What chat and completions share; the subclasses hold where they differ."""

    name: ClassVar[str]
    route: ClassVar[str]
    logprobs_asked: ClassVar[Any]
    """The ``logprobs`` value the gateway sends when it asks for the sampled tokens' logprobs itself."""
    top_keys: ClassVar[tuple[str, ...]]
    choice_keys: ClassVar[tuple[str, ...]]
    """vLLM's field order (its pydantic response models, serialised compactly by ``model_dump`` + starlette's
    ``JSONResponse``); ``strip.fast_strip`` relies on it, anything else takes the msgspec path."""
    prompt_ids_per_choice: ClassVar[bool]
    """``prompt_token_ids`` in each choice (completions) or once at the top (chat)."""

    def request_error(self, body: dict[str, Any]) -> tuple[str, str] | None:
        """(message, param) when the body lacks what this endpoint needs; vLLM validates the rest."""
        raise NotImplementedError

    def one_choice(self, body: dict[str, Any]) -> bool:
        """The answer has exactly one choice (lets the byte-level strip skip one search)."""
        return False

    def asks(self, body: dict[str, Any]) -> tuple[bool, bool]:
        """(token ids, logprobs): what the gateway must ask for itself to record from the JSON, i.e. what
        the client did not ask for (and so must be set back to ``null`` in what it gets)."""
        return not body.get("return_token_ids"), self._logprobs_missing(body)

    def _logprobs_missing(self, body: dict[str, Any]) -> bool:
        raise NotImplementedError

    def strip_chunk(self, chunk: dict[str, Any], ids: bool, logprobs: bool) -> None:
        """Set what the gateway asked for on its own behalf back to vLLM's ``null`` in a stream chunk."""
        if ids and not self.prompt_ids_per_choice and "prompt_token_ids" in chunk:
            chunk["prompt_token_ids"] = None
        for choice in chunk.get("choices") or ():
            if ids:
                if "token_ids" in choice:
                    choice["token_ids"] = None
                if self.prompt_ids_per_choice and "prompt_token_ids" in choice:
                    choice["prompt_token_ids"] = None
            if logprobs and "logprobs" in choice:
                choice["logprobs"] = None

    def stripped_choice_keys(self, ids: bool, logprobs: bool) -> tuple[str, ...]:
        keys = ("logprobs",) if logprobs else ()
        if ids:
            keys += ("token_ids", "prompt_token_ids") if self.prompt_ids_per_choice else ("token_ids",)
        return keys

    def logprobs_shape(self, raw: bytes, start: int, end: int) -> bool:
        """Whether ``raw[start:end]`` begins and ends as the logprobs the gateway asks for do. Not a parse:
        it catches a key another vLLM version would put between ``logprobs`` and ``finish_reason`` unless
        that key's value ends exactly like a logprobs value (``test_field_order_is_vllms`` pins the order)."""
        raise NotImplementedError

    def decode_output(self, fields: dict[str, msgspec.Raw]) -> tuple[str, list[dict[str, Any]] | None]:
        """(text, tool calls) of one choice of a whole body, its fields still undecoded."""
        raise NotImplementedError

    def decode_logprobs(self, raw: msgspec.Raw) -> list[float | None]:
        """The sampled tokens' logprobs of one choice of a whole body (only what a record needs is decoded)."""
        raise NotImplementedError

    def chunk_output(self, choice: dict[str, Any]) -> tuple[str | None, list[dict[str, Any]] | None, list[Any]]:
        """(text delta, tool-call deltas, logprobs entries) of one choice of a stream chunk."""
        raise NotImplementedError

    def before_output(self, event: bytes) -> bool:
        """A stream event sent before any generated token (chat's role chunk): not time to first token."""
        return False


class Chat(Endpoint):
    name, route = "chat", "/v1/chat/completions"
    logprobs_asked = True
    top_keys = ("id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage",
                "prompt_logprobs", "prompt_token_ids", "prompt_text", "kv_transfer_params", "ec_transfer_params",
                "metrics")
    choice_keys = ("index", "message", "logprobs", "finish_reason", "stop_reason", "token_ids", "routed_experts")
    prompt_ids_per_choice = False
    _ROLE_CHUNK = b'"delta":{"role":"assistant","content":""}'

    def request_error(self, body: dict[str, Any]) -> tuple[str, str] | None:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            return "'messages' must be a non-empty list of objects", "messages"
        return None

    def one_choice(self, body: dict[str, Any]) -> bool:
        return body.get("n") in (None, 1)

    def _logprobs_missing(self, body: dict[str, Any]) -> bool:
        return not body.get("logprobs")

    def logprobs_shape(self, raw: bytes, start: int, end: int) -> bool:  # no top_logprobs asked
        if raw.startswith(b'{"content":[{"token":"', start):
            return raw.endswith((b'],"top_logprobs":[]}]}', b'null,"top_logprobs":[]}]}'), start, end)
        return raw[start:end] in (b'{"content":null}', b'{"content":[]}')

    def decode_output(self, fields: dict[str, msgspec.Raw]) -> tuple[str, list[dict[str, Any]] | None]:
        message = (_ANY.decode(fields["message"]) if "message" in fields else None) or {}
        return message.get("content") or "", message.get("tool_calls") or None

    def decode_logprobs(self, raw: msgspec.Raw) -> list[float | None]:
        lp = _CHAT_LP.decode(raw)
        return [e.logprob for e in lp.content] if lp is not None and lp.content else []

    def chunk_output(self, choice: dict[str, Any]) -> tuple[str | None, list[dict[str, Any]] | None, list[Any]]:
        delta = choice.get("delta") or {}
        lp = choice.get("logprobs") or {}
        return delta.get("content"), delta.get("tool_calls") or None, lp.get("content") or []

    def before_output(self, event: bytes) -> bool:
        return self._ROLE_CHUNK in event


class Completions(Endpoint):
    name, route = "completions", "/v1/completions"
    logprobs_asked = 0  # the sampled token's logprob, no alternatives
    top_keys = ("id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage",
                "kv_transfer_params", "ec_transfer_params", "metrics")
    choice_keys = ("index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids", "prompt_logprobs",
                   "prompt_token_ids", "routed_experts")
    prompt_ids_per_choice = True
    _DIGITS = frozenset(b"0123456789")

    def request_error(self, body: dict[str, Any]) -> tuple[str, str] | None:
        if not isinstance(body.get("prompt"), str | list):
            return "'prompt' must be a string or a list", "prompt"
        return None

    def _logprobs_missing(self, body: dict[str, Any]) -> bool:
        return body.get("logprobs") is None

    def logprobs_shape(self, raw: bytes, start: int, end: int) -> bool:  # logprobs=0: one {token: logprob} each
        if not raw.startswith(b'{"text_offset":[', start):
            return False
        return ((raw.endswith(b"}]}", start, end) and raw[end - 4] in self._DIGITS)
                or raw.endswith((b"null]}", b'"top_logprobs":[]}'), start, end))

    def decode_output(self, fields: dict[str, msgspec.Raw]) -> tuple[str, list[dict[str, Any]] | None]:
        return (_ANY.decode(fields["text"]) if "text" in fields else None) or "", None

    def decode_logprobs(self, raw: msgspec.Raw) -> list[float | None]:
        lp = _COMPLETION_LP.decode(raw)
        return list(lp.token_logprobs or []) if lp is not None else []

    def chunk_output(self, choice: dict[str, Any]) -> tuple[str | None, list[dict[str, Any]] | None, list[Any]]:
        lp = choice.get("logprobs") or {}
        return choice.get("text"), None, lp.get("token_logprobs") or []


CHAT, COMPLETIONS = Chat(), Completions()
ENDPOINTS: dict[str, Endpoint] = {e.name: e for e in (CHAT, COMPLETIONS)}
