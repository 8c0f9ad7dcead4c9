"""Forward ``/v1/chat/completions`` and ``/v1/completions`` to an upstream and log what it produced.

For the record the gateway asks vLLM for the sampled tokens' logprobs and the token ids; when the
client did not ask for them itself they are set back to the ``null`` vLLM returns when they are not
requested, so the client receives what vLLM would have returned for its own request. Records are
built and encoded in the producer (a non-streamed body goes there as the bytes vLLM sent); a failed
or cut-off response produces no record.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import quote

import aiohttp
import msgspec
import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from streamrl.broker.schema import RecordError, check_id, check_purpose
from streamrl.engine.wire import (
    BODY,
    CAPTURE_HEADER,
    DEFER_PREFIX,
    FOLLOW_HEADER,
    FOLLOW_KEEP,
    FOLLOW_RECOMPUTE,
    FrameSplitter,
    WireError,
    unframe,
)

from .auth import KEY_STATE, PINNED_VERSION_SCOPE
from .config import GatewayConfig
from .metrics import GatewayMetrics
from .policy import Lease, PolicyTable
from .recording.capture import CallContext, StreamCapture, usage_tokens
from .recording.capture_stream import consumer_for
from .recording.recorder import Recorder
from .strip import client_body
from .upstreams import Upstream, UpstreamPool
from .wire import Endpoint

log = logging.getLogger(__name__)

JSON = "application/json"
_RETRYABLE = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)
"""Failures before any response byte: the request can go to another upstream unseen by the client."""
_DONE_EVENT = b"data: [DONE]\n\n"


class BadRequest(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError", 413: "RequestEntityTooLarge",
                500: "InternalServerError", 502: "BadGateway", 503: "ServiceUnavailable", 504: "GatewayTimeout"}


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    """An OpenAI-style error body, the shape vLLM uses too."""
    return orjson.dumps({"error": {"message": message, "type": _ERROR_TYPES.get(status, "Error"),
                                   "param": param, "code": status}})


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    return Response(error_body(status, message, param), status, headers=headers, media_type=JSON)


async def read_body(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise BadRequest(413, f"request body is over the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BadRequest(413, f"request body is over the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_request(raw: bytes, endpoint: Endpoint) -> dict[str, Any]:
    """Validate what the gateway itself relies on; vLLM validates the rest and its 400 is passed on."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(400, f"invalid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest(400, "'model' must be a non-empty string", "model")
    missing = endpoint.request_error(body)
    if missing is not None:
        raise BadRequest(400, *missing)
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest(400, "'stream' must be a boolean", "stream")
    n = body.get("n", 1)
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise BadRequest(400, "'n' must be a positive integer", "n")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise BadRequest(400, "'metadata' must be an object", "metadata")
    return body


def _tag(request: Request, metadata: dict[str, Any] | None, header: str, key: str) -> str | None:
    value = request.headers.get(header)
    if value is None and metadata is not None:
        value = metadata.get(key)
    try:
        return check_id(value, key, optional=True)
    except RecordError as exc:
        raise BadRequest(400, str(exc), key) from None


def header_value(text: str) -> str:
    """An id echoed in a response header: as it is when printable ASCII, else percent-encoded (UTF-8), since
    header values are bytes of Latin-1 at most and may hold no control characters."""
    return text if text.isascii() and text.isprintable() else quote(text, safe="")


class _Call:
    """One request's state while it is forwarded."""

    __slots__ = ("ctx", "deferred", "endpoint", "engine_capture", "headers", "lease", "one_choice", "record",
                 "strip_ids", "strip_logprobs", "upstream")

    def __init__(self, endpoint: Endpoint, ctx: CallContext, lease: Lease, record: bool, one_choice: bool = False) -> None:
        self.endpoint = endpoint
        self.one_choice = one_choice
        """The reply has exactly one choice (``Endpoint.one_choice``)."""
        self.ctx, self.lease, self.record = ctx, lease, record
        self.strip_ids = self.strip_logprobs = False
        """Plain-vLLM path: what the gateway asked for in the JSON on its own behalf, to set back to null."""
        self.engine_capture = False
        """The upstream hands the tokens over in a capture frame (``engine/wire.py``)."""
        self.deferred = False
        """... or, asked to, on its capture stream to the record producer (``capture_stream.py``)."""
        self.upstream: Upstream | None = None
        self.headers = {"X-Request-Id": ctx.request_id, "X-Trajectory-Id": header_value(ctx.trajectory_id)}
        if ctx.group_id is not None:
            self.headers["X-Group-Id"] = header_value(ctx.group_id)
        if lease.policy_name is not None:
            self.headers["X-Policy-Version"] = str(lease.version)


_OUR_KEYS = frozenset(("trajectory_id", "group_id", "purpose"))
"""The gateway's own keys in a request's ``metadata``: removed before it goes upstream."""


class _Payload:
    """The body for vLLM, made for the upstream the request goes to: the engine-side model and the client's
    body without the gateway's tags; when recording from a plain vLLM, with logprobs and token ids asked for
    in the JSON too (``call.strip_*`` then say what to set back to ``null``)."""

    __slots__ = ("_json", "_sent", "body", "call", "raw")

    def __init__(self, call: _Call, body: dict[str, Any], raw: bytes, metadata: dict[str, Any] | None) -> None:
        self.call, self.body = call, body
        sent: dict[str, Any] | None = None
        if call.lease.engine_model != body["model"]:
            sent = dict(body)
            sent["model"] = call.lease.engine_model
        if metadata is not None and not _OUR_KEYS.isdisjoint(metadata):
            sent = sent or dict(body)
            rest = {k: v for k, v in metadata.items() if k not in _OUR_KEYS}
            if rest:
                sent["metadata"] = rest
            else:
                del sent["metadata"]
        self.raw = raw if sent is None else orjson.dumps(sent)
        self._sent = sent
        self._json: bytes | None = None

    def for_upstream(self, up: Upstream) -> bytes:
        call = self.call
        call.engine_capture = call.record and up.token_capture is True
        if not call.record or call.engine_capture:
            call.strip_ids = call.strip_logprobs = False
            return self.raw
        body = self.body
        call.strip_ids, call.strip_logprobs = call.endpoint.asks(body)
        if self._json is None:
            sent = dict(self._sent or body)
            if call.strip_ids:
                sent["return_token_ids"] = True
            if call.strip_logprobs:
                sent["logprobs"] = call.endpoint.logprobs_asked
            self._json = orjson.dumps(sent) if (call.strip_ids or call.strip_logprobs) else self.raw
        return self._json


class _Relay(StreamingResponse):
    """A streaming response that always runs its clean-up, even if the client left before the first byte."""

    def __init__(self, content: AsyncIterator[bytes], status: int, headers: dict[str, str],
                 on_close: Callable[[], None]) -> None:
        super().__init__(content, status, headers=headers, media_type="text/event-stream")
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class _Frames:
    """A framed stream's progress, shared by its relay and whatever reads on after the client left."""

    __slots__ = ("captured", "ended", "events", "splitter")

    def __init__(self) -> None:
        self.splitter = FrameSplitter()
        self.events: list[tuple[float, bytes]] = []
        """The ``B`` frames' events with their arrival times (``perf_counter``), for the record."""
        self.ended = False
        """``data: [DONE]`` has been relayed: the answer is complete but for the capture."""
        self.captured = False


class Proxy:
    def __init__(self, config: GatewayConfig, pool: UpstreamPool, policies: PolicyTable, metrics: GatewayMetrics, *,
                 auth_on: bool = False) -> None:
        self.config, self.pool, self.policies = config, pool, policies
        self.auth_on = auth_on
        """API keys are checked (``auth.AuthMiddleware`` put the request's key in its scope)."""
        self.metrics = metrics
        self.recorder: Recorder | None = None
        """Where served calls' answers go to be recorded (set by the gateway's start; None: logging off)."""
        self.session: aiohttp.ClientSession | None = None
        self.fresh_session: aiohttp.ClientSession | None = None
        """Never reuses a connection: for the retry after an upstream hung up on a pooled one."""
        self._timeout = aiohttp.ClientTimeout(total=None, connect=config.connect_timeout_s,
                                              sock_read=config.upstream_timeout_s)
        self._upstream_headers = {"Content-Type": JSON, **config.extra_headers}
        self._capture_headers = {**self._upstream_headers, CAPTURE_HEADER: "1"}
        self._in_flight = config.update_mode == "in-flight"
        self._follow = FOLLOW_RECOMPUTE if config.in_flight_cache == "recompute" else FOLLOW_KEEP
        """The follow header's value: the cache policy at a move."""
        self._consumer: str | None = None
        """With ``defer_to``: the record producer's name on the upstreams' capture streams."""
        self._deferred_headers: dict[str, dict[str, str]] = {}
        """Per upstream URL: the headers asking it for deferred capture (``capture_stream.consumer_for``)."""
        self._fallback_logged = False
        self._late_captures: set[asyncio.Task[None]] = set()
        """``_late_capture`` tasks in progress (the loop keeps only weak references to tasks)."""

    def defer_to(self, consumer: str) -> None:
        """Ask upstreams that offer it to queue non-streamed calls' captures for ``consumer``, the record
        producer's id on their capture streams (``gateway/recording/capture_stream.py``)."""
        self._consumer = consumer

    def _deferring(self, up: Upstream) -> dict[str, str]:
        headers = self._deferred_headers.get(up.url)
        if headers is None:
            assert self._consumer is not None
            consumer = consumer_for(self._consumer, up.url)
            headers = self._deferred_headers[up.url] = {**self._upstream_headers,
                                                         CAPTURE_HEADER: DEFER_PREFIX + consumer}
        return headers

    async def finish_late_captures(self, timeout_s: float) -> None:
        """At shutdown, before the producer closes: give streams still reading on to their capture frame
        (``_late_capture``) up to ``timeout_s`` to be recorded."""
        if self._late_captures:
            await asyncio.wait(set(self._late_captures), timeout=timeout_s)
        if self.recorder is not None:
            self.recorder.flush()

    async def handle(self, request: Request, endpoint: Endpoint) -> Response:
        started = time.perf_counter()
        route = endpoint.route
        try:
            response = await self._handle(request, endpoint, started)
        except BadRequest as exc:
            response = error_response(exc.status, exc.message, exc.param)
        except asyncio.CancelledError:
            # What cancels a call's handler is uvicorn, for the calls still running when its graceful shutdown
            # (``shutdown_grace_s``) ends (a client that goes away does not cancel it). The call is over either
            # way, nothing was recorded for it; answered 503, it spares the log the traceback uvicorn prints for
            # every cancellation that escapes the app (a hundred of them for a busy gateway's stop).
            response = error_response(503, "the gateway is shutting down; retry on another gateway")
        except Exception as exc:  # a bug must cost one request, never the gateway
            log.exception("request failed in the gateway")
            response = error_response(500, f"gateway error: {type(exc).__name__}")
        if not isinstance(response, _Relay):
            self.metrics.observe(route, response.status_code, time.perf_counter() - started)
        return response

    async def _handle(self, request: Request, endpoint: Endpoint, started: float) -> Response:
        raw = await read_body(request, self.config.max_body_bytes)
        body = parse_request(raw, endpoint)
        metadata = body.get("metadata")
        trajectory_id = _tag(request, metadata, "x-trajectory-id", "trajectory_id") or os.urandom(16).hex()
        group_id = _tag(request, metadata, "x-group-id", "group_id")
        try:
            purpose = check_purpose(request.headers.get("x-streamrl-purpose") or (metadata or {}).get("purpose")
                                    or "train")
        except RecordError as exc:
            raise BadRequest(400, str(exc), "purpose") from None
        key = request.scope.get(KEY_STATE)
        lease = self.policies.resolve(body["model"], trajectory_id)
        if lease is None:
            raise BadRequest(404, f"The model `{body['model']}` does not exist.", "model")
        if self.auth_on and not key.may_use(lease.policy_name):
            lease.release()
            raise BadRequest(403, f"This API key ({key.key_id}) may not use `{body['model']}`; it may use "
                                  f"{', '.join(f'`{p}`' for p in sorted(key.policies or ()))}", "model")
        if self.auth_on and lease.policy_name is not None and body["model"] != lease.policy_name \
                and PINNED_VERSION_SCOPE not in key.scopes:
            lease.release()
            raise BadRequest(403, f"pinning a policy version (`{body['model']}`) needs an API key with the "
                                  f"'{PINNED_VERSION_SCOPE}' scope; ask for `{lease.policy_name}`", "model")
        ctx = CallContext(trajectory_id=trajectory_id, group_id=group_id, endpoint=endpoint.name, model=body["model"],
                          policy_name=lease.policy_name, policy_version=lease.version,
                          request=body if self.config.record_request else {}, started=started, purpose=purpose,
                          key_id=key.key_id if key is not None else None)
        call = _Call(endpoint, ctx, lease, record=self.recorder is not None, one_choice=endpoint.one_choice(body))
        try:
            payload = _Payload(call, body, raw, metadata)
            response = await self._forward(call, payload, bool(body.get("stream")))
        except BaseException:
            lease.release()
            raise
        if lease.policy_name is not None:
            self.metrics.policy_requests.labels(lease.policy_name, str(response.status_code)).inc()
        if not isinstance(response, _Relay):
            lease.release()
        return response

    async def _connect(self, call: _Call, payload: _Payload, stream: bool) -> aiohttp.ClientResponse | Response:
        """Send to the least-busy upstream; on a failure before any response byte, try another."""
        assert self.session is not None
        model = call.lease.engine_model
        excluded: tuple[Upstream, ...] = ()
        hung_up = False
        slow: set[str] = set()
        """Upstreams that took no connection within ``connect_timeout_s`` once already."""
        timed_out = False
        """The last try's failure was such a timeout."""
        for _ in range(2 * len(self.pool.upstreams) + 1):  # an upstream is excluded after two failures at most
            up = self.pool.pick(model, excluded)
            if up is None:
                break
            up.in_flight += 1
            session = self.fresh_session if hung_up and self.fresh_session is not None else self.session
            try:
                data = payload.for_upstream(up)
                call.deferred = (call.engine_capture and up.deferred_capture and not stream
                                 and self._consumer is not None)
                headers = (self._deferring(up) if call.deferred else self._capture_headers if call.engine_capture
                           else self._upstream_headers)
                if self._in_flight and call.lease.follows and call.engine_capture and up.moves_requests:
                    headers = {**headers, FOLLOW_HEADER: self._follow}  # it may move to a newer version while it runs
                    call.lease.mark(up.url)
                resp = await session.post(up.url + call.endpoint.route, data=data, timeout=self._timeout,
                                          headers=headers)
            except aiohttp.ClientConnectorError as exc:
                timed_out = False
                up.in_flight -= 1
                self.pool.mark_failed(up, f"connect: {exc}")
                excluded += (up,)
            except _RETRYABLE as exc:
                timed_out = False
                up.in_flight -= 1
                if hung_up:  # it hung up on a new connection too: it is the upstream, not a stale connection
                    excluded += (up,)
                hung_up = True
                log.info("upstream %s dropped the request before answering (%s); retrying", up.url, exc)
            except aiohttp.ConnectionTimeoutError:
                # nothing was sent: a busy host (an engine filling the CPUs, a pause) or a lost SYN; once more,
                # then elsewhere
                up.in_flight -= 1
                if up.url in slow:
                    excluded += (up,)
                slow.add(up.url)
                timed_out = True
                log.info("upstream %s took no connection within %.1f s; retrying", up.url,
                         self.config.connect_timeout_s)
            except TimeoutError:
                up.in_flight -= 1
                return error_response(504, "upstream timed out", headers=call.headers)
            else:
                call.upstream = up
                call.ctx.upstream = up.url
                return resp
            self.metrics.retries.inc()
        if timed_out:
            return error_response(504, f"upstream took no connection within {self.config.connect_timeout_s:g} s "
                                       "(tried twice)", headers=call.headers)
        if call.lease.policy_name is not None and call.lease.version > 0:
            message = f"no healthy upstream has policy version {call.lease.version} loaded"
        else:
            message = f"no healthy upstream serves `{model}`"
        return error_response(503, message, headers=call.headers)

    def _done_with_upstream(self, call: _Call) -> None:
        if call.upstream is not None:
            call.upstream.in_flight -= 1
            call.upstream = None

    async def _forward(self, call: _Call, payload: _Payload, stream: bool) -> Response:
        resp = await self._connect(call, payload, stream)
        if isinstance(resp, Response):
            return resp
        if stream and resp.status == 200:
            return self._stream(call, resp)
        try:
            raw = await resp.read()
        except TimeoutError:
            return error_response(504, "upstream timed out", headers=call.headers)
        except aiohttp.ClientError as exc:
            return error_response(502, f"upstream failed: {exc}", headers=call.headers)
        finally:
            resp.release()
            self._done_with_upstream(call)
        content_type = resp.headers.get("Content-Type", JSON)
        if resp.status == 200 and call.engine_capture:
            call.lease.reached_engine()
            return self._engine_body(call, resp, raw, content_type)
        if resp.status != 200 or not (call.record or call.strip_ids or call.strip_logprobs):
            return Response(raw, resp.status, headers=call.headers, media_type=content_type)
        try:
            out = client_body(raw, call.ctx.endpoint, call.strip_ids, call.strip_logprobs, call.one_choice)
        except msgspec.MsgspecError as exc:  # not the JSON vLLM sends: pass it on, record nothing
            log.warning("unexpected upstream body from %s: %s", call.ctx.upstream, exc)
            return Response(raw, 200, headers=call.headers, media_type=content_type)
        if out.fallback is not None:
            self.metrics.slow_strips.inc()
            self._log_fallback(out.fallback)
        if self.recorder is not None:
            self.recorder.answer(call.ctx, raw, out.choices, usage_tokens(out.usage))
        return Response(out.body, 200, headers=call.headers, media_type=content_type)

    def _engine_body(self, call: _Call, resp: aiohttp.ClientResponse, raw: bytes, content_type: str) -> Response:
        """A non-streamed answer of ``streamrl engine``: vLLM's bytes to the client, the capture to the record
        (framed in the answer, or deferred: then the producer joins it with the context sent here)."""
        said = resp.headers.get(CAPTURE_HEADER)
        if call.deferred and said != "1":
            self._record_deferred(call, raw, said)
            return Response(raw, 200, headers=call.headers, media_type=content_type)
        if said != "1":  # not framed after all (e.g. restarted as a plain vLLM)
            self._record_engine(call, raw, None)
            return Response(raw, 200, headers=call.headers, media_type=content_type)
        try:
            body, capture = unframe(raw)
        except WireError as exc:
            log.warning("unusable framed body from %s: %s", call.ctx.upstream, exc)
            return error_response(502, f"upstream sent an unusable body: {exc}", headers=call.headers)
        self._record_engine(call, body, capture)
        return Response(body, 200, headers=call.headers, media_type=content_type)

    def _log_fallback(self, reason: str) -> None:
        """The first body that the byte-level strip could not take is logged (e.g. another vLLM version's
        field order: every body then costs the msgspec pass), the rest only at debug level."""
        if self._fallback_logged:
            log.debug("body stripped by the msgspec path: %s", reason)
        else:
            self._fallback_logged = True
            log.info("an upstream body is not in vLLM's compact field order (%s): stripped by the slower "
                     "msgspec path; further ones are logged at debug level", reason)

    def _stream(self, call: _Call, resp: aiohttp.ClientResponse) -> Response:
        headers = dict(call.headers)
        headers["Cache-Control"] = "no-cache"
        if call.engine_capture and resp.headers.get(CAPTURE_HEADER) == "1":
            frames = _Frames()

            def on_close_framed() -> None:
                if frames.ended and not frames.captured and not resp.content.at_eof():
                    task = asyncio.get_running_loop().create_task(self._late_capture(call, resp, frames))
                    self._late_captures.add(task)
                    task.add_done_callback(self._late_captures.discard)
                else:
                    self._end_stream(call, resp)

            return _Relay(self._relay_frames(call, resp, frames), 200, headers, on_close_framed)
        capture = StreamCapture(call.ctx.endpoint) if call.record and not call.engine_capture else None
        if call.engine_capture:  # not framed after all: pass it on, record nothing (counted)
            self._record_engine(call, b"", None)
        return _Relay(self._relay(call, resp, capture), 200, headers, functools.partial(self._end_stream, call, resp))

    def _end_stream(self, call: _Call, resp: aiohttp.ClientResponse) -> None:
        resp.release()
        self._done_with_upstream(call)
        call.lease.release()

    async def _relay_frames(self, call: _Call, resp: aiohttp.ClientResponse, frames: _Frames) -> AsyncIterator[bytes]:
        """A stream from ``streamrl engine``: ``B`` frames' bytes go to the client as they come; the events
        are kept with their arrival times for the record, which is handed over at the ``C`` frame. The
        engine sends it before ``data: [DONE]`` when it can, since the openai client hangs up on [DONE],
        which cancels this generator; a capture still to come then is read in the background
        (``_late_capture``)."""
        started = call.ctx.started
        first_output = False
        try:
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                out = []
                for kind, payload in frames.splitter.feed(data):
                    if kind == BODY:
                        out.append(payload)
                        frames.events.append((now, payload))
                        if not first_output and not call.endpoint.before_output(payload):
                            first_output = True
                            self.metrics.ttft.observe(now - started)
                            call.lease.reached_engine()
                        frames.ended = frames.ended or payload.endswith(_DONE_EVENT)
                    else:
                        frames.captured = True
                        self._record_engine(call, frames.events, payload)
                if out:
                    yield out[0] if len(out) == 1 else b"".join(out)
            if frames.splitter.pending:
                raise WireError(f"stream cut off inside a frame ({frames.splitter.pending} bytes)")
            if not frames.captured:  # the engine could not send it: counted as an invalid call
                self._record_engine(call, frames.events, None)
        except (TimeoutError, aiohttp.ClientError, WireError) as exc:
            status = 504 if isinstance(exc, TimeoutError) else 502  # before the capture: nothing was recorded
            yield b"data: " + error_body(status, f"upstream stream ended: {type(exc).__name__}") + b"\n\n"
        finally:
            self.metrics.observe(call.endpoint.route, 200, time.perf_counter() - started)

    async def _late_capture(self, call: _Call, resp: aiohttp.ClientResponse, frames: _Frames) -> None:
        """The client left after ``[DONE]``, before the capture frame came: read on to it (within the
        upstream read timeout), so that the call is recorded all the same."""
        try:
            async for data in resp.content.iter_any():
                for kind, payload in frames.splitter.feed(data):
                    if kind != BODY:
                        self._record_engine(call, frames.events, payload)
                        return
            self._record_engine(call, frames.events, None)  # ended without one: counted as an invalid call
        except (TimeoutError, aiohttp.ClientError, WireError) as exc:
            log.warning("no capture frame after the end of a stream from %s: %s", call.ctx.upstream, exc)
        finally:
            self._end_stream(call, resp)

    async def _relay(self, call: _Call, resp: aiohttp.ClientResponse,
                     capture: StreamCapture | None) -> AsyncIterator[bytes]:
        started = call.ctx.started
        failed = False
        strip = call.strip_ids or call.strip_logprobs
        buffer = b""
        try:
            async for data in resp.content.iter_any():
                if capture is None and not strip:
                    yield data
                    continue
                buffer += data
                *events, buffer = buffer.split(b"\n\n")
                out = []
                now = time.perf_counter()
                for event in events:
                    if not event.startswith(b"data: "):
                        out.append(event + b"\n\n")
                        continue
                    payload = event[6:]
                    if payload == b"[DONE]":
                        # recorded before the client sees the end: the openai client closes the
                        # connection on [DONE], and the server then cancels this generator
                        if capture is not None and not failed:
                            self._record_stream(call, capture)
                        out.append(event + b"\n\n")
                        continue
                    try:
                        chunk = orjson.loads(payload)
                    except orjson.JSONDecodeError:
                        failed = True
                        out.append(event + b"\n\n")
                        continue
                    if "error" in chunk:
                        failed = True
                    elif capture is not None:
                        capture.add(chunk, now)
                    if strip:
                        call.endpoint.strip_chunk(chunk, call.strip_ids, call.strip_logprobs)
                        out.append(b"data: " + orjson.dumps(chunk) + b"\n\n")
                    else:
                        out.append(event + b"\n\n")
                if out:
                    yield b"".join(out)
            if buffer:
                yield buffer
        except (TimeoutError, aiohttp.ClientError) as exc:
            status = 504 if isinstance(exc, TimeoutError) else 502  # before [DONE]: nothing was recorded
            yield b"data: " + error_body(status, f"upstream stream ended: {type(exc).__name__}") + b"\n\n"
        finally:
            self.metrics.observe(call.endpoint.route, 200, time.perf_counter() - started)

    def _record_engine(self, call: _Call, body: bytes | list[tuple[float, bytes]], capture: bytes | None) -> None:
        if self.recorder is not None:
            self.recorder.engine_answer(call.ctx, body, capture)

    def _record_deferred(self, call: _Call, raw: bytes, said: str | None) -> None:
        if self.recorder is not None:
            self.recorder.deferred(call.ctx, raw, said)

    def _record_stream(self, call: _Call, capture: StreamCapture) -> None:
        if self.recorder is not None:
            self.recorder.stream(call.ctx, capture)
