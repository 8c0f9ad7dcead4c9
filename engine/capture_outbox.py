"""Deferred captures inside the engine's API server: one outbox per consumer, and the stream that drains it.

Part of ``engine/capture.py`` (the protocol is in ``engine/wire.py``, "Deferred capture"). A
gateway whose records are built in a producer process of its own asks for non-streamed answers to be served
plain and their captures queued here; its producer process reads them on a long-lived stream. That keeps
the capture (and a copy of the body, which the record's text comes from) off the gateway's event loop: it
then moves vLLM's bytes as with logging off, and hands its producer a few hundred bytes per call.

Bounds: an outbox holds at most ``MAX_QUEUED_BYTES``; what does not fit, and what waits longer than
``ORPHAN_AFTER_S`` without a reader, is dropped and counted (``ANOMALIES``: ``deferred_dropped``), never
kept without limit. Frames handed to a stream that then breaks are lost with it; the gateway's producer
counts the calls whose capture never came as invalid.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import itertools
import os
import secrets
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import parse_qs

from streamrl.engine.wire import HEARTBEAT, deferred_frame, frame, valid_consumer

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]
Receive = Callable[[], Awaitable[Message]]

MAX_QUEUED_BYTES = 256 << 20
ORPHAN_AFTER_S = 120.0
"""Captures queued for a consumer that has had no reader for this long are dropped (a gateway gone)."""
HEARTBEAT_S = 2.0
INSTANCE = os.urandom(6).hex()
"""This API server process's part of every token: a restarted engine's tokens never match an old one's."""
_SEQ = itertools.count(1)


def new_token() -> str:
    return f"{INSTANCE}-{next(_SEQ)}"


class Outbox:
    """The captures waiting for one consumer's stream."""

    __slots__ = ("frames", "queued_bytes", "reader", "reader_seen", "ready")

    def __init__(self) -> None:
        self.frames: collections.deque[bytes] = collections.deque()
        self.queued_bytes = 0
        self.ready = asyncio.Event()
        self.reader: object | None = None
        """The stream reading now (a new one replaces it); None while none is connected."""
        self.reader_seen = time.monotonic()

    def put(self, data: bytes, anomalies: collections.Counter[str]) -> bool:
        now = time.monotonic()
        if self.reader is None and self.frames and now - self.reader_seen > ORPHAN_AFTER_S:
            anomalies["deferred_dropped"] += len(self.frames)
            self.frames.clear()
            self.queued_bytes = 0
        if self.queued_bytes + len(data) > MAX_QUEUED_BYTES:
            anomalies["deferred_dropped"] += 1
            return False
        self.frames.append(data)
        self.queued_bytes += len(data)
        self.ready.set()
        return True

    def take(self) -> bytes:
        data = b"".join(self.frames)
        self.frames.clear()
        self.queued_bytes = 0
        self.ready.clear()
        return data


class Outboxes:
    """Every consumer's outbox in this API server process."""

    def __init__(self, anomalies: collections.Counter[str]) -> None:
        self.anomalies = anomalies
        self.boxes: dict[str, Outbox] = {}
        self.queued = 0
        """Captures queued since start (``deferred`` answers sent)."""

    def box(self, consumer: str) -> Outbox:
        """The consumer's outbox, made on its first capture or stream (forgetting those of consumers gone)."""
        box = self.boxes.get(consumer)
        if box is None:
            self._forget_idle()
            box = self.boxes[consumer] = Outbox()
        return box

    def put(self, consumer: str, token: str, body: bytes, capture: bytes) -> bool:
        self.queued += 1
        return self.box(consumer).put(deferred_frame(token, body, capture), self.anomalies)

    def _forget_idle(self) -> None:
        """Drop the outboxes of consumers long gone, with what they held (counted): every restart of a gateway
        is a new consumer, and the old one's captures would otherwise stay here."""
        now = time.monotonic()
        for name in [n for n, b in self.boxes.items() if b.reader is None and now - b.reader_seen > ORPHAN_AFTER_S]:
            self.anomalies["deferred_dropped"] += len(self.boxes.pop(name).frames)

    def state(self) -> dict[str, Any]:
        return {"queued": self.queued, "consumers": len(self.boxes),
                "waiting": sum(len(b.frames) for b in self.boxes.values()),
                "readers": sum(b.reader is not None for b in self.boxes.values())}

    async def serve_stream(self, scope: Message, receive: Receive, send: Send, api_keys: list[str]) -> None:
        """``GET STREAM_PATH?consumer=...``: the consumer's captures as ``D`` frames, ``H`` when idle, until it
        hangs up or another stream of the same consumer replaces this one. With vLLM API keys set, the
        stream needs one (``Authorization: Bearer``): it carries the conversations."""
        if api_keys and not _authorised(scope, api_keys):
            return await _answer(send, 401, b'{"error":"Unauthorized"}')
        consumer = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("consumer", [""])[0]
        if not valid_consumer(consumer):
            return await _answer(send, 400, b'{"error":"consumer: 1 to 64 of A-Z a-z 0-9 _ -"}')
        box = self.box(consumer)
        claim = object()
        box.reader = claim
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/octet-stream"), (b"cache-control", b"no-store")]})
        gone = asyncio.ensure_future(_disconnected(receive))
        broken = False
        try:
            while box.reader is claim:
                if not box.frames:
                    waiting = asyncio.ensure_future(box.ready.wait())
                    await asyncio.wait((waiting, gone), timeout=HEARTBEAT_S, return_when=asyncio.FIRST_COMPLETED)
                    waiting.cancel()
                    if gone.done() or box.reader is not claim:
                        break
                data = box.take() if box.frames else frame(HEARTBEAT, b"")
                await send({"type": "http.response.body", "body": data, "more_body": True})
        except OSError:  # the reader's connection broke mid-send
            broken = True
        finally:
            if box.reader is claim:
                box.reader = None
                box.reader_seen = time.monotonic()
        if not (broken or gone.done()):  # replaced by a newer stream of the same consumer: end this one
            with contextlib.suppress(OSError):
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        gone.cancel()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _authorised(scope: Message, api_keys: list[str]) -> bool:
    value = next((v for k, v in scope["headers"] if k == b"authorization"), b"").decode("latin-1")
    scheme, _, key = value.partition(" ")
    if scheme.lower() != "bearer":
        return False
    digest = hashlib.sha256(key.encode()).digest()
    return any(secrets.compare_digest(digest, hashlib.sha256(k.encode()).digest()) for k in api_keys)


async def _answer(send: Send, status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
