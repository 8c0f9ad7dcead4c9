"""Deferred captures, the gateway's producer side: each upstream's capture stream read, and every call's
context joined with its capture there, off the gateway's event loop.

With ``streamrl engine`` upstreams that offer it (``engine/wire.py``, "Deferred capture"), a
non-streamed call's answer comes back plain, naming its capture by a token, and the event loop hands its
producer only the call's context, waiting for ``<upstream> <token>`` (``LogProducer.offer_parts(wait_for=)``).
``DeferredCaptures`` is that producer's ``Waiter``: one thread per upstream reads the stream of captures the
engine queued for this gateway (``GET /streamrl/capture/stream?consumer=...``), and whichever of a call's two
halves comes second completes it. A context whose capture has not come within ``wait_s`` (the engine
restarted, its stream broke) is counted invalid, as a call without a capture always was; a capture whose
context never comes (the call's hand-off was dropped) is counted as an orphan and forgotten.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import http.client
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from streamrl.engine.wire import DEFERRED, STREAM_PATH, FrameSplitter, WireError, decode_deferred
from streamrl.gateway.recording.delivery import INVALID
from streamrl.gateway.recording.log_producer import Item, Waiting

log = logging.getLogger(__name__)

READ_TIMEOUT_S = 10.0
"""A stream that sends nothing for this long (the engine sends a heartbeat every 2 s) is reconnected."""


def deferred_captures(deliver: Callable[[Item], None], counts: Any, consumer: str, headers: dict[str, str],
                      wait_s: float) -> DeferredCaptures:
    """The ``WaiterSpec`` factory (``LogProducer(waiter=...)``)."""
    return DeferredCaptures(deliver, counts, consumer, headers, wait_s)


def consumer_for(consumer: str, upstream: str) -> str:
    """The consumer name this gateway's producer uses with one upstream: one outbox, and one stream, per
    upstream URL, so that two URLs reaching the same engine (a relay, an alias) never share an outbox (their
    streams would take it from each other, and the captures of one would arrive on the other's)."""
    return f"{consumer}-{hashlib.sha256(upstream.encode()).hexdigest()[:10]}"


def wait_key(upstream: str, token: str) -> bytes:
    """What a call's context waits for: its upstream's URL and the token the answer named."""
    return f"{upstream} {token}".encode()


class DeferredCaptures:
    """Joins calls' contexts (``Waiting``) with their captures from the upstreams' capture streams."""

    def __init__(self, deliver: Callable[[Item], None], counts: Any, consumer: str, headers: dict[str, str],
                 wait_s: float) -> None:
        self.deliver, self.counts, self.consumer, self.headers = deliver, counts, consumer, headers
        self.wait_s = wait_s
        self.lock = threading.Lock()
        self.waiting: dict[bytes, tuple[Waiting, float]] = {}
        """Contexts whose capture has not come yet, with their deadlines."""
        self.arrived: dict[bytes, tuple[bytes, bytes, float]] = {}
        """Captures (body, capture) whose context has not come yet, with their deadlines."""
        self.readers: dict[str, _StreamReader] = {}
        self.timed_out = self.orphans = 0
        self.closing = threading.Event()
        threading.Thread(target=self._sweep, name="streamrl-capture-sweep", daemon=True).start()

    def offer(self, waiting: Waiting) -> None:
        upstream = waiting.key.split(b" ", 1)[0].decode()
        if upstream not in self.readers:
            self.readers[upstream] = _StreamReader(upstream, self)
        with self.lock:
            got = self.arrived.pop(waiting.key, None)
            if got is None:
                self.waiting[waiting.key] = (waiting, time.monotonic() + self.wait_s)
                return
        self._complete(waiting, got[0], got[1])

    def arrive(self, upstream: str, token: str, body: bytes, capture: bytes) -> None:
        key = wait_key(upstream, token)
        with self.lock:
            entry = self.waiting.pop(key, None)
            if entry is None:
                self.arrived[key] = (body, capture, time.monotonic() + self.wait_s)
                return
        self._complete(entry[0], body, capture)

    def _complete(self, waiting: Waiting, body: bytes, capture: bytes) -> None:
        self.deliver((waiting.topic, None, functools.partial(waiting.build, *waiting.parts, body, capture),
                      waiting.count))

    def _sweep(self) -> None:
        while not self.closing.wait(1.0):
            self.expire(time.monotonic())

    def expire(self, now: float) -> None:
        """Count and forget contexts and captures past their deadlines."""
        with self.lock:
            late = [k for k, (_, deadline) in self.waiting.items() if deadline <= now]
            records = sum(self.waiting.pop(k)[0].count for k in late)
            orphans = [k for k, (_, _, deadline) in self.arrived.items() if deadline <= now]
            for k in orphans:
                del self.arrived[k]
        if late:
            self.timed_out += len(late)
            self.counts[INVALID] += records
            log.warning("%d calls' captures did not come from their upstreams' capture streams within %.0f s "
                        "(%d records counted invalid; e.g. %s)", len(late), self.wait_s, records, late[0].decode())
        if orphans:
            self.orphans += len(orphans)
            log.warning("%d captures came without their calls (the calls' hand-off was dropped)", len(orphans))

    def close(self) -> None:
        """Give contexts still waiting a few seconds for their captures, then count the rest and stop."""
        deadline = time.monotonic() + min(self.wait_s, 5.0)
        while self.waiting and time.monotonic() < deadline:
            time.sleep(0.02)
        self.closing.set()
        for reader in self.readers.values():
            reader.stop()
        self.expire(float("inf"))


class _StreamReader:
    """One upstream's capture stream, read in a thread of its own, reconnecting with backoff."""

    def __init__(self, upstream: str, owner: DeferredCaptures) -> None:
        self.upstream, self.owner = upstream, owner
        self.sock: socket.socket | None = None
        threading.Thread(target=self._run, name="streamrl-capture-stream", daemon=True).start()

    def stop(self) -> None:
        sock = self.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _run(self) -> None:
        backoff = 0.1
        while not self.owner.closing.is_set():
            try:
                if self._read():
                    backoff = 0.1
            except (OSError, http.client.HTTPException, WireError) as exc:
                if not self.owner.closing.is_set():
                    log.warning("capture stream of %s: %s; reconnecting", self.upstream, exc)
            self.owner.closing.wait(backoff)
            backoff = min(backoff * 2, 5.0)

    def _read(self) -> bool:
        """Read the stream until it ends; whether it was open at all."""
        url = urlsplit(self.upstream)
        kind = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        conn = kind(url.hostname or "localhost", url.port, timeout=READ_TIMEOUT_S)
        try:
            consumer = consumer_for(self.owner.consumer, self.upstream)
            conn.request("GET", f"{url.path.rstrip('/')}{STREAM_PATH}?consumer={consumer}",
                         headers=self.owner.headers)
            self.sock = conn.sock
            resp = conn.getresponse()
            if resp.status != 200:
                raise http.client.HTTPException(f"{STREAM_PATH} answered {resp.status}: {resp.read(200)!r}")
            splitter = FrameSplitter(stream=True)
            while data := resp.read1(1 << 20):
                for kind_, payload in splitter.feed(data):
                    if kind_ == DEFERRED:
                        token, body, capture = decode_deferred(payload)
                        self.owner.arrive(self.upstream, token, body, capture)
            return True
        finally:
            self.sock = None
            conn.close()
