"""Token capture inside vLLM's API server: sampled ids and sampling logprobs as arrays, at plain-serving cost.

Loaded by ``streamrl engine`` through vLLM's own extension point, ``--middleware
streamrl.engine.capture.CaptureMiddleware``; the protocol it speaks to the gateway is in
``engine/wire.py``. Why it exists: a request with ``logprobs`` makes vLLM's API server process
build Python objects per sampled token (a ``Logprob`` with its decoded string in the output processor,
then pydantic models and JSON in the serving layer) and that process, not the GPU, bounded generation
(docs/benchmarks.md, "Token capture"). Here a request marked by the gateway is served exactly as the plain
request it is (same body, same response bytes), while:

1. its ``SamplingParams.logprobs`` is set to 0 as it enters the output processor, before it is sent to
   the engine core, so the sampler returns the sampled token's logprob (under ``--logprobs-mode``), and
   its ``extra_args`` carry ``vllm_capture_scheduler.MARK``, so that the engine core's scheduler sends
   those logprobs as one column per step rather than numpy arrays per request
   (``engine/capture_scheduler.py``);
2. each step's engine-core output of such a request gives up its new token ids here, and its logprobs are
   cut from the step's column, before the output processor would turn them into objects; vLLM's own
   logprob handling then sees none (unless the client asked for logprobs itself: then it gets them too,
   from vLLM's arrays);
3. when the response ends, the arrays go to the gateway in a ``C`` frame.

Two methods of the server's one ``OutputProcessor`` instance are replaced by this module's (``add_request``,
``process_outputs``): vLLM has no extension point for either, so ``vllm_hooks.hook_output_processor`` puts them
in place (the engine core's half is a scheduler subclass named through vLLM's ``--scheduler-cls``, no patch),
pinned to the vLLM versions it was tested on (``vllm_hooks.TESTED_VERSIONS``); on any other version, or if the
shapes it relies on are missing, nothing is replaced, the probe answers 404 and the gateway uses the plain path.
"""

from __future__ import annotations

import collections
import contextvars
import itertools
import logging
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import numpy as np
import orjson

from streamrl.engine.capture_outbox import Outboxes, new_token
from streamrl.engine.capture_scheduler import MARK, STEP_KEY
from streamrl.engine.inflight import FOLLOW, KEEP, MOVES_KEY, RECOMPUTE, served_version
from streamrl.engine.vllm_hooks import hook_output_processor
from streamrl.engine.wire import (
    BODY,
    CAPTURE,
    CAPTURE_HEADER,
    CAPTURE_PATHS,
    DEFER_PREFIX,
    FOLLOW_HEADER,
    FOLLOW_KEEP,
    FOLLOW_RECOMPUTE,
    FORMAT_VERSION,
    FORMATS,
    NO_CAPTURE,
    PROBE_PATH,
    STREAM_PATH,
    capture_counts,
    deferred_header,
    encode_capture,
    frame,
    valid_consumer,
)

log = logging.getLogger("vllm.streamrl_capture")
"""Under vLLM's logger: vLLM configures only its own namespace, so this is how these lines reach the engine's
log with vLLM's format and level."""

ANOMALIES: collections.Counter[str] = collections.Counter()
"""Calls whose capture went wrong, by kind (``duplicate_request_id``; ended without a capture:
``no_choice`` (no request of the call reached the output processor in its context) or ``cut_off`` (the
answer ended before its last body), or ``client_gone`` (the gateway hung up first, e.g. killed: not a
fault); sent with ``unfinished`` choices; ``not_encoded``; ``not_in_step``: an output whose request the
step's column does not list; ``deferred_dropped``: a deferred capture its consumer never read): served to the gateway's probe (``GET /streamrl/capture``) so that a soak or a test can
ask, whatever the logging set-up."""


Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_HEADER_KEY = CAPTURE_HEADER.lower().encode()
_FOLLOW_KEY = FOLLOW_HEADER.lower().encode()
_CONTENT_TYPE = b"content-type"
OUTBOXES = Outboxes(ANOMALIES)
"""Deferred captures waiting for their consumers' streams (``engine/capture_outbox.py``)."""
_DONE = b"data: [DONE]\n\n"
_CURRENT: contextvars.ContextVar[_Capture | None] = contextvars.ContextVar("streamrl_capture", default=None)
"""The capture of the HTTP request being served; read where vLLM adds the request's engine requests."""


class _Choice:
    """One engine request (one choice) being captured."""

    __slots__ = ("done", "external_id", "index", "keep_vllm_logprobs", "logprobs", "prompt", "request_id",
                 "spans", "token_chunks")

    def __init__(self, request_id: str, external_id: str, index: int, prompt: list[int] | None,
                 keep_vllm_logprobs: bool, version: int = 0) -> None:
        self.request_id = request_id
        """vLLM's internal id of this engine request (one per choice)."""
        self.external_id = external_id
        self.index = index
        self.prompt = prompt
        self.keep_vllm_logprobs = keep_vllm_logprobs
        self.token_chunks: list[list[int]] = []
        """The engine outputs' own ``new_token_ids`` lists: vLLM trims one in place when a stop string ends
        the choice inside a step, and the capture sees the trim."""
        self.logprobs: list[np.ndarray] = []
        """The sampled tokens' logprobs (float32), step after step."""
        self.done = False
        self.spans: list[tuple[int, int]] = [(0, version)]
        """(first token index, adapter version): where the engine core moved it (``engine/inflight.py``)."""

    def moved(self, first_token: int, version: int) -> None:
        kept = [s for s in self.spans if s[0] < first_token]  # a move before a version's first token replaces it
        self.spans = kept if kept and kept[-1][1] == version else [*kept, (first_token, version)]

    def version_spans(self, tokens: int) -> list[tuple[int, int]]:
        """The spans that cover ``tokens`` sampled tokens (a move after the last one says nothing of them)."""
        return [s for s in self.spans if s[0] == 0 or s[0] < tokens]

    def logprob_array(self) -> np.ndarray:
        return np.concatenate(self.logprobs) if self.logprobs else np.zeros(0, np.float32)


def follow_policy(header: bytes | None) -> str | None:
    """The cache policy a ``FOLLOW_HEADER`` value asks for (``1``: keep, ``recompute``), None: no moves."""
    return {FOLLOW_KEEP.encode(): KEEP, FOLLOW_RECOMPUTE.encode(): RECOMPUTE}.get(header) if header else None


class _Capture:
    """What one HTTP request's engine requests produced."""

    __slots__ = ("choices", "endpoint", "follow")

    def __init__(self, endpoint: str, follow: str | None = None) -> None:
        self.endpoint = endpoint
        self.follow = follow
        """The gateway asked for in-flight updates (with this cache policy at a move, ``inflight.KEEP`` or
        ``RECOMPUTE``): the requests may move, the capture carries version spans."""
        self.choices: list[_Choice] = []

    def complete(self) -> bool:
        return bool(self.choices) and all(c.done for c in self.choices)

    def encode(self) -> bytes:
        """The ``C`` payload. Choice indices follow vLLM's: chat, the child index; completions, prompt
        ``i`` of a batch has request id ``<id>-<i>`` and its choices are ``i * n + child index``."""
        order: dict[str, int] = {}
        for c in self.choices:
            order.setdefault(c.external_id, len(order))
        if self.endpoint == "completions" and len(order) > 1:
            ranked = sorted(order, key=lambda e: int(e.rsplit("-", 1)[1]))
            order = {e: i for i, e in enumerate(ranked)}
        n = len(self.choices) // len(order)
        prompts: list[np.ndarray] = [np.zeros(0, np.int32)] * len(order)
        choices = []
        spans = []
        for c in self.choices:
            slot = order[c.external_id]
            if c.prompt is None:
                raise ValueError("an engine request without prompt token ids (prompt embeddings)")
            prompts[slot] = np.asarray(c.prompt, np.int32)
            ids = np.fromiter(itertools.chain.from_iterable(c.token_chunks), np.int32)
            logprobs = c.logprob_array()
            if len(logprobs) < len(ids):
                raise ValueError(f"choice {c.index}: {len(ids)} tokens but {len(logprobs)} logprobs")
            index = slot * n + c.index if self.endpoint == "completions" else c.index
            choices.append((index, slot, ids, logprobs[: len(ids)]))
            spans.append(c.version_spans(len(ids)))
        return encode_capture(prompts, choices, spans if self.follow else None)


class _Step:
    """One step's sampled-token logprobs, as the engine core's ``capture_scheduler`` sent them."""

    __slots__ = ("column", "left", "rows", "starts")

    def __init__(self, count: int, rows: dict[str, int], column: np.ndarray, starts: list[int] | None) -> None:
        self.left = count
        self.rows, self.column, self.starts = rows, column, starts

    def cut(self, request_id: str, tokens: int) -> np.ndarray:
        """A request's logprobs, the rows vLLM's own ``slice_request`` would give it."""
        row = self.rows.get(request_id)
        if row is None:  # not in the step it came with: the capture will not encode, and says so
            ANOMALIES["not_in_step"] += 1
            return self.column[:0]
        start = self.starts[row] if self.starts is not None else row
        return self.column[start:start + tokens]


class _OutputProcessorHooks:
    """The two wrapped methods of the server's ``OutputProcessor`` and the choices in flight."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        self.live: dict[str, _Choice] = {}
        """Internal engine request id -> its choice, while the engine produces it."""
        self.column_steps = 0
        """Captured outputs whose logprobs were cut from their step's column (the core runs ``capture_scheduler``)."""
        self.array_steps = 0
        """Captured outputs whose logprobs came as vLLM's arrays (a client's own ``logprobs``, or a plain core)."""
        self._step: _Step | None = None
        self.moves = 0
        """Requests the engine core moved to a newer adapter version while they ran (``engine/inflight.py``)."""
        self.moves_to: collections.Counter[str] = collections.Counter()
        """The same, by the version they moved to (its served name, ``<policy>@v<N>``)."""
        """The column of the step whose message is being processed, and how many of its outputs are to come."""
        self._add_request = processor.add_request  # vLLM's own, called from ours
        self._process_outputs = processor.process_outputs

    def add_request(self, request: Any, prompt: Any, parent_req: Any = None, request_index: int = 0,
                    queue: Any = None) -> None:
        capture = _CURRENT.get()
        params = getattr(request, "sampling_params", None)
        if capture is not None and params is not None and request.request_id in self.live:
            ANOMALIES["duplicate_request_id"] += 1
            log.warning("streamrl capture: request id %s is already being captured (a second request with the "
                        "same id); this one is not captured", request.request_id)
        elif capture is not None and params is not None:
            keep = params.logprobs is not None
            if not keep:
                params.logprobs = 0  # the sampled token's logprob only; the engine core reads it from here
                params.extra_args = {**(params.extra_args or {}), MARK: True}  # ... in its step's column
            served = served_version(getattr(getattr(request, "lora_request", None), "lora_name", None))
            if capture.follow and served is not None:
                params.extra_args = {**(params.extra_args or {}), FOLLOW: capture.follow}
            choice = _Choice(request.request_id, request.external_req_id or request.request_id, request_index,
                             request.prompt_token_ids, keep, served[1] if served is not None else 0)
            capture.choices.append(choice)
            self.live[request.request_id] = choice
        return self._add_request(request, prompt, parent_req, request_index, queue)

    def process_outputs(self, engine_core_outputs: list[Any], *args: Any, **kwargs: Any) -> Any:
        step = self._step_of(engine_core_outputs)
        if not self.live:
            return self._process_outputs(engine_core_outputs, *args, **kwargs)
        seen = []
        live = self.live
        for out in engine_core_outputs:
            choice = live.get(out.request_id)
            if choice is None:
                continue
            seen.append((out.request_id, choice))
            tokens = out.new_token_ids
            choice.token_chunks.append(tokens)
            if out.new_logprobs is not None:  # a client's own logprobs, or an engine core without the column
                choice.logprobs.append(out.new_logprobs.logprobs[:, 0].astype(np.float32))
                self.array_steps += 1
                if not choice.keep_vllm_logprobs:
                    out.new_logprobs = None
            elif step is not None and tokens:
                choice.logprobs.append(step.cut(out.request_id, len(tokens)))
                self.column_steps += 1
        result = self._process_outputs(engine_core_outputs, *args, **kwargs)
        states = self.processor.request_states
        for request_id, choice in seen:
            # The step's token list is vLLM's own object: kept by reference through _process_outputs, which
            # trims it in place at a stop string, then copied, because vLLM later extends that same list in
            # place when it merges a lagging stream reader's outputs (RequestOutput.add): a reference held on
            # would count the next steps' tokens twice (seen as "9 tokens but 8 logprobs" under load).
            choice.token_chunks[-1] = list(choice.token_chunks[-1])
            if request_id not in states:  # finished (also by a stop string found here) or aborted
                choice.done = True
                live.pop(request_id, None)
        return result

    def _step_of(self, engine_core_outputs: list[Any]) -> _Step | None:
        """The step column these outputs are cut from. vLLM's output handler hands the processor one step's
        message in chunks, in order, so the column rides on the first output of the first chunk
        (``vllm_capture_scheduler.attach_step``) and serves as many outputs as the message holds."""
        if len(engine_core_outputs):
            first = engine_core_outputs[0]
            extra = first.kv_transfer_params
            if extra is not None and (STEP_KEY in extra or MOVES_KEY in extra):  # taken out in any case
                if STEP_KEY in extra:
                    count, rows, column, starts = extra.pop(STEP_KEY)
                    self._step = _Step(count, rows, np.frombuffer(column, np.float32), starts)
                moves = extra.pop(MOVES_KEY, ())
                if not extra:
                    first.kv_transfer_params = None
                for request_id, first_token, version, name in moves:
                    self.moves += 1
                    self.moves_to[name] += 1
                    choice = self.live.get(request_id)
                    if choice is not None:
                        choice.moved(first_token, version)
        step = self._step
        if step is not None:
            step.left -= len(engine_core_outputs)
            if step.left <= 0:
                self._step = None
        return step

    def forget(self, capture: _Capture) -> None:
        """Drop what an ended HTTP request left (its client went away while the engine was producing)."""
        for choice in capture.choices:
            self.live.pop(choice.request_id, None)


def install(engine_client: Any) -> _OutputProcessorHooks | str:
    """Wrap the engine client's output processor, or say why not (the probe then answers 404)."""
    return hook_output_processor(engine_client, _OutputProcessorHooks)


class CaptureMiddleware:
    """Pure ASGI middleware (vLLM's ``--middleware``): the probe, the deferred captures' stream, and framed or
    deferred answers for marked requests."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app
        self._hooks: _OutputProcessorHooks | str | None = None
        self.defers = False
        """Deferred capture is offered: this is vLLM's only API server process (a consumer's stream would
        otherwise reach one process while its answers come from others)."""
        self.api_keys: list[str] = []
        """vLLM's API keys (``--api-key``, ``VLLM_API_KEY``): the capture stream asks for one too."""

    def hooks(self, scope: Scope) -> _OutputProcessorHooks | str:
        """Installed on the first request that needs them (the engine client exists by then)."""
        if self._hooks is None:
            state = scope["app"].state
            engine_client = getattr(state, "engine_client", None)
            if engine_client is None:
                return "no engine client yet"  # asked again on the next request
            self._hooks = install(engine_client)
            if isinstance(self._hooks, str):
                log.warning("streamrl token capture off: %s", self._hooks)
            else:
                self.defers, self.api_keys = _server_settings(state)
                log.info("streamrl token capture on (format %d; deferred captures %s)", FORMAT_VERSION,
                         "offered" if self.defers else "not offered: several API server processes")
        return self._hooks

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        if path == PROBE_PATH:
            return await self._probe(scope, send)
        endpoint = CAPTURE_PATHS.get(path)
        if endpoint is None:
            if path == STREAM_PATH and not isinstance(self.hooks(scope), str) and self.defers:
                return await OUTBOXES.serve_stream(scope, receive, send, self.api_keys)
            return await self.app(scope, receive, send)
        asked = next((v for k, v in scope["headers"] if k == _HEADER_KEY), None)
        if asked is None:
            return await self.app(scope, receive, send)
        hooks = self.hooks(scope)
        if isinstance(hooks, str):
            return await self.app(scope, receive, send)
        capture = _Capture(endpoint, follow_policy(next((v for k, v in scope["headers"] if k == _FOLLOW_KEY), None)))
        token = _CURRENT.set(capture)
        consumer = asked[len(DEFER_PREFIX):].decode("latin-1") if asked.startswith(DEFER_PREFIX.encode()) else ""
        wrapped: _FramedSend | _DeferredSend = (_DeferredSend(send, capture, consumer)
                                                if self.defers and valid_consumer(consumer)
                                                else _FramedSend(send, capture))
        gone = False

        async def watched_receive() -> Message:
            nonlocal gone
            message = await receive()
            gone = gone or message["type"] == "http.disconnect"
            return message

        try:
            await self.app(scope, watched_receive, wrapped)
        finally:
            _CURRENT.reset(token)
            hooks.forget(capture)
            if wrapped.framed and not wrapped.sent:
                if gone:  # the gateway hung up (e.g. it was killed): nobody is left to record the call
                    ANOMALIES["client_gone"] += 1
                else:  # the gateway counts the call invalid
                    kind = "cut_off" if capture.choices else "no_choice"
                    ANOMALIES[kind] += 1
                    log.warning("streamrl capture: a 200 answer to %s ended without its capture (%s: %d "
                                "choices seen)", scope["path"], kind, len(capture.choices))

    async def _probe(self, scope: Scope, send: Send) -> None:
        import vllm

        hooks = self.hooks(scope)
        if isinstance(hooks, str):
            status, body = 404, {"error": {"message": f"token capture off: {hooks}", "code": 404}}
        else:
            status, body = 200, {"format": FORMAT_VERSION, "formats": list(FORMATS), "in_flight_moves": hooks.moves,
                                 "in_flight_moves_to": dict(sorted(hooks.moves_to.items())),
                                 "vllm": vllm.__version__, "deferred": self.defers,
                                 "logprob_steps": {"column": hooks.column_steps, "arrays": hooks.array_steps},
                                 "outboxes": OUTBOXES.state(), "anomalies": dict(ANOMALIES),
                                 "lora": _lora_slots(scope["app"].state)}
        raw = orjson.dumps(body)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]})
        await send({"type": "http.response.body", "body": raw})


def _lora_slots(state: Any) -> dict[str, int] | None:
    """The engine's LoRA slots (``--max-loras``, ``--max-cpu-loras``, ``--max-lora-rank``), or None with LoRA
    off: a gateway in front of an engine it did not start checks them against its policies from the probe."""
    lora = getattr(getattr(state, "vllm_config", None), "lora_config", None)
    if lora is None:
        return None
    return {"max_loras": int(lora.max_loras), "max_cpu_loras": int(lora.max_cpu_loras or lora.max_loras),
            "max_lora_rank": int(lora.max_lora_rank)}


def _server_settings(state: Any) -> tuple[bool, list[str]]:
    """(whether this is vLLM's only API server process, its API keys), from the app state vLLM 0.26 and 0.32
    keep (``vllm_config``, ``args``)."""
    parallel = getattr(getattr(state, "vllm_config", None), "parallel_config", None)
    count = getattr(parallel, "_api_process_count", None)
    args = getattr(state, "args", None)
    keys = getattr(args, "api_key", None)
    if isinstance(keys, str):
        keys = [keys]
    keys = [k for k in (keys or [os.environ.get("VLLM_API_KEY", "")]) if k]
    return count == 1, keys


_unfinished_noted = False


def _note_unfinished(capture: _Capture) -> None:
    """A response ended with a choice not seen to finish: logged once (then at debug level), with what tells
    the cases apart, since it was sent all the same."""
    global _unfinished_noted
    detail = [(c.request_id, sum(map(len, c.token_chunks)), sum(map(len, c.logprobs))) for c in capture.choices
              if not c.done]
    if _unfinished_noted:
        log.debug("streamrl capture sent with unfinished choices (request id, tokens, logprobs): %s", detail)
    else:
        _unfinished_noted = True
        log.warning("streamrl capture sent with choices not seen to finish (request id, tokens, logprobs): %s; "
                    "further ones are logged at debug level", detail)


def _encoded(capture: _Capture) -> bytes | None:
    """The capture payload of an answer that is ending, or None (counted) when it cannot be encoded: the
    gateway then records nothing for the call and counts it. vLLM ends an answer once every choice's last
    output went through the output processor, so the capture holds every token sent, whether or not each
    choice was seen to finish (``_Choice.done``); ``encode`` checks each choice's tokens against its logprobs."""
    if not capture.complete():
        ANOMALIES["unfinished"] += 1
        _note_unfinished(capture)
    try:
        return capture.encode()
    except ValueError as exc:
        ANOMALIES["not_encoded"] += 1
        log.warning("streamrl capture not sent: %s", exc)
        return None


class _FramedSend:
    """Wraps ``send``: a 200 answer's bytes go out in ``B`` frames, the capture in a ``C`` frame before the end."""

    __slots__ = ("capture", "framed", "send", "sent")

    def __init__(self, send: Send, capture: _Capture) -> None:
        self.send, self.capture = send, capture
        self.framed = self.sent = False

    async def __call__(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            if message["status"] == 200:
                self.framed = True
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"content-length"]
                headers.append((_HEADER_KEY, b"1"))
                message = {**message, "headers": headers}
            return await self.send(message)
        if kind != "http.response.body" or not self.framed:
            return await self.send(message)
        body = message.get("body", b"")
        more = message.get("more_body", False)
        parts = []
        if not self.sent and (not more or body.endswith(_DONE)) and self.capture.choices:
            self.sent = True
            payload = _encoded(self.capture)
            if payload is not None:
                parts.append(frame(CAPTURE, payload))
        if body:
            parts.append(frame(BODY, body))
        await self.send({"type": "http.response.body", "body": b"".join(parts), "more_body": more})


class _DeferredSend:
    """Wraps ``send`` for a ``defer=`` request: a non-streamed 200 answer goes out as vLLM made it, plus the
    header naming its capture, which goes (with a copy of the body, where the record's text comes from) to the
    consumer's outbox before the answer's first byte; a streamed answer is framed as ``_FramedSend`` does."""

    __slots__ = ("capture", "chunks", "consumer", "framed", "framing", "send", "sent", "start")

    def __init__(self, send: Send, capture: _Capture, consumer: str) -> None:
        self.send, self.capture, self.consumer = send, capture, consumer
        self.framed = self.sent = False
        self.start: Message | None = None
        """vLLM's ``http.response.start``, held until the body is complete (the header names the capture)."""
        self.chunks: list[bytes] = []
        self.framing: _FramedSend | None = None

    async def __call__(self, message: Message) -> None:
        if self.framing is not None:
            await self.framing(message)
            self.framed, self.sent = self.framing.framed, self.framing.sent
            return
        kind = message["type"]
        if kind == "http.response.start":
            if message["status"] != 200:
                return await self.send(message)
            content_type = next((v for k, v in message.get("headers", ()) if k.lower() == _CONTENT_TYPE), b"")
            if content_type.startswith(b"text/event-stream"):
                self.framing = _FramedSend(self.send, self.capture)
                return await self(message)
            self.framed = True
            self.start = message
            return
        if kind != "http.response.body" or self.start is None:
            return await self.send(message)
        self.chunks.append(message.get("body", b""))
        if message.get("more_body", False):
            return
        body = b"".join(self.chunks)
        self.chunks.clear()
        start, self.start = self.start, None
        value = self._queue(body)
        self.sent = True
        await self.send({**start, "headers": [*start.get("headers", ()), (_HEADER_KEY, value.encode())]})
        await self.send({"type": "http.response.body", "body": body})

    def _queue(self, body: bytes) -> str:
        """The capture into the consumer's outbox; the header value that names it (``none``: the gateway
        counts the call invalid)."""
        if not self.capture.choices:
            ANOMALIES["no_choice"] += 1
            return NO_CAPTURE
        payload = _encoded(self.capture)
        if payload is None:
            return NO_CAPTURE
        token = new_token()
        if not OUTBOXES.put(self.consumer, token, body, payload):
            return NO_CAPTURE
        return deferred_header(token, capture_counts(payload))
