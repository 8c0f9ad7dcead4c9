"""``LogProducer``: what a latency-sensitive server (the gateway) logs through. ``offer()`` never blocks
and never raises. Records go into a bounded buffer drained by a background thread, or through a pipe
(``frame_pipe``) into a child process, that owns the KafkaProducer; when the buffer is full or the broker
is unreachable, records are counted as dropped / failed instead of slowing a response.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import pickle
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kafka import KafkaProducer

from .clients import DEFAULT_COMPRESSION, PLAINTEXT, make_producer
from .frame_pipe import FrameReader, PipeWriter
from .security import KafkaSecurity

log = logging.getLogger(__name__)


@dataclass
class ProducerStats:
    offered: int = 0
    delivered: int = 0
    failed: int = 0
    """Sent but not acknowledged (broker unreachable, timeouts)."""
    dropped: int = 0
    """Refused at the door because the buffer was full."""
    invalid: int = 0
    """Deferred records whose value could not be built (nothing was sent for them)."""
    bytes_delivered: int = 0
    waited: int = 0
    """Records that found the pipe to the producer process full and waited in the backlog (a producer
    process falling behind; each such wait wakes a thread in the server)."""

    @property
    def undelivered(self) -> int:
        return self.failed + self.dropped


Build = Callable[[], list[tuple[bytes | None, bytes]]]
"""Makes (key, value) pairs on the producer's side, so encoding stays off the caller's thread. With
``LogProducer(process=True)`` it must be picklable (e.g. a ``functools.partial`` of a module-level function)."""

_DELIVERED, _FAILED, _INVALID, _BYTES = range(4)
Item = tuple[str, bytes | None, bytes | Build, int]


class _Sender:
    """Owns the KafkaProducer: builds deferred records, sends, counts outcomes into ``counts``
    (a plain list in a thread, shared memory in a child process)."""

    def __init__(self, bootstrap_servers: str, compression: str | None, send_timeout_ms: int, client_id: str,
                 counts: Any, security: KafkaSecurity = PLAINTEXT) -> None:
        self.bootstrap_servers, self.compression, self.security = bootstrap_servers, compression, security
        self.send_timeout_ms, self.client_id, self.counts = send_timeout_ms, client_id, counts
        self.lock = threading.Lock()
        self.producer: KafkaProducer | None = None

    def _count(self, index: int, n: int = 1) -> None:
        with self.lock:
            self.counts[index] += n

    def _connect(self) -> KafkaProducer | None:
        try:
            return make_producer(self.bootstrap_servers, security=self.security, compression=self.compression,
                                 max_block_ms=self.send_timeout_ms, request_timeout_ms=self.send_timeout_ms,
                                 delivery_timeout_ms=self.send_timeout_ms + 5_000, client_id=self.client_id,
                                 linger_ms=20)
        except Exception as exc:  # broker down at start: keep serving, retry on the next record
            log.warning("cannot connect producer to %s: %s", self.bootstrap_servers, exc)
            return None

    def _on_ok(self, nbytes: int) -> Callable[[Any], None]:
        def ok(_meta: Any) -> None:
            with self.lock:
                self.counts[_DELIVERED] += 1
                self.counts[_BYTES] += nbytes
        return ok

    def _on_err(self, exc: BaseException) -> None:
        self._count(_FAILED)
        log.debug("record not delivered: %s", exc)

    def handle(self, item: Item) -> None:
        topic, key, value, count = item
        if callable(value):
            try:
                pairs = value()
            except Exception as exc:
                self._count(_INVALID, count)
                log.warning("record not built: %s", exc)
                return
        else:
            pairs = [(key, value)]
        if self.producer is None:
            self.producer = self._connect()
            if self.producer is None:
                self._count(_FAILED, len(pairs))
                time.sleep(0.2)
                return
        for k, v in pairs:
            try:
                fut = self.producer.send(topic, key=k, value=v)
                fut.add_callback(self._on_ok(len(v))).add_errback(self._on_err)
            except Exception as exc:  # metadata timeout, buffer exhausted in the client
                self._on_err(exc)

    def close(self) -> None:
        if self.producer is None:
            return
        try:
            self.producer.flush(timeout=self.send_timeout_ms / 1000)
        except Exception as exc:  # broker gone: what is left is counted by the errbacks
            log.warning("records left undelivered at close: %s", exc)
        try:
            self.producer.close(timeout=0)
        except Exception as exc:
            log.debug("producer close: %s", exc)


def _collect_rarely() -> None:
    """Keep the producer process from stopping for full garbage collections.

    Building one record allocates thousands of short-lived objects (decoded logprobs); with the default
    thresholds that sets off full collections of the process's heap (kafka-python, msgspec, numpy) every
    few hundred records, during which the process reads nothing from the pipe, the pipe fills and the
    server's records wait in its backlog, which is when its response-time tail grew (docs/gateway.md,
    "How it keeps overhead low"). Freezing what exists after start-up and collecting young objects less
    often (as the gateway does for itself) removes them; the records' own objects are freed by
    reference counting."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 100)


def _child_main(conn: Any, bootstrap_servers: str, compression: str | None, send_timeout_ms: int,
                client_id: str, counts: Any, security: KafkaSecurity) -> None:
    """The producer process: receives pickled items until an empty frame, then flushes and exits."""
    # The parent decides when to stop: a Ctrl-C or a SIGTERM sent to the whole process group must not
    # lose what is buffered here. The pipe closing (the parent gone) ends this loop too.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _collect_rarely()
    sender = _Sender(bootstrap_servers, compression, send_timeout_ms, client_id, counts, security)
    try:
        for data in FrameReader(conn.fileno()):
            sender.handle(pickle.loads(data))
    finally:
        sender.close()


class LogProducer:
    """Fire-and-forget producer for servers: bounded buffer, counters, never blocks the caller.

    With ``process=True`` the KafkaProducer and the building of deferred records run in a child process
    fed through a pipe, so that neither holds the server's GIL: kafka-python batches records in Python,
    and a server's event loop should not wait for that. Without it, one background thread owns the
    KafkaProducer and drains a bounded queue. ``max_buffered`` bounds the records waiting on this side,
    ``max_buffered_bytes`` (process mode) their bytes too: what is over either is dropped and counted."""

    def __init__(self, bootstrap_servers: str, *, max_buffered: int = 100_000, max_buffered_bytes: int = 256 << 20,
                 compression: str | None = DEFAULT_COMPRESSION, send_timeout_ms: int = 10_000,
                 client_id: str = "streamrl-gateway", process: bool = False,
                 security: KafkaSecurity = PLAINTEXT) -> None:
        self.bootstrap_servers, self.security = bootstrap_servers, security
        self.max_buffered = max_buffered
        self._offered = self._dropped = self._unsendable = 0
        self._send_timeout_ms = send_timeout_ms
        self._process = None
        self._pipe: PipeWriter | None = None
        self._queue: queue.Queue[Item | None] = queue.Queue(max_buffered)
        if process:
            ctx = multiprocessing.get_context("spawn")
            self._counts: Any = ctx.Array("q", 4, lock=False)
            reader, writer = ctx.Pipe(duplex=False)
            self._process = ctx.Process(target=_child_main, name="streamrl-log-producer", daemon=True,
                                        args=(reader, bootstrap_servers, compression, send_timeout_ms, client_id,
                                              self._counts, security))
            self._process.start()
            reader.close()
            self._pipe = PipeWriter(writer, max_buffered, max_buffered_bytes)
        else:
            self._counts = [0, 0, 0, 0]
            self._sender = _Sender(bootstrap_servers, compression, send_timeout_ms, client_id, self._counts,
                                   security)
            self._thread = threading.Thread(target=self._run, name="streamrl-log-producer", daemon=True)
            self._thread.start()

    @property
    def stats(self) -> ProducerStats:
        c = self._counts
        lost, waited = (self._pipe.lost, self._pipe.waited) if self._pipe is not None else (0, 0)
        return ProducerStats(offered=self._offered, delivered=c[_DELIVERED], failed=c[_FAILED] + lost,
                             dropped=self._dropped, invalid=c[_INVALID] + self._unsendable, bytes_delivered=c[_BYTES],
                             waited=waited)

    def offer(self, topic: str, key: bytes | None, value: bytes) -> bool:
        """Queue a record; False (and counted as dropped) when the buffer is full. Never blocks."""
        return self._put((topic, key, value, 1))

    def offer_deferred(self, topic: str, build: Build, count: int) -> bool:
        """Queue ``count`` records whose bytes ``build()`` makes later, off the caller's thread.
        If ``build`` raises, none of them is sent and all are counted as invalid."""
        return self._put((topic, None, build, count))

    def _put(self, item: Item) -> bool:
        n = item[3]
        self._offered += n
        if self._pipe is not None:
            try:
                ok = self._pipe.put(item, n)
            except (pickle.PicklingError, TypeError, AttributeError) as exc:  # a build that cannot travel
                self._unsendable += n
                log.warning("record not handed to the producer process: %s", exc)
                return False
        else:
            try:
                self._queue.put_nowait(item)
                ok = True
            except queue.Full:
                ok = False
        if not ok:
            self._dropped += n
        return ok

    @property
    def buffered(self) -> int:
        """Items waiting on this side (not yet in the pipe or the KafkaProducer)."""
        return self._pipe.buffered if self._pipe is not None else self._queue.qsize()

    @property
    def capacity(self) -> int:
        return self.max_buffered

    @property
    def pipe_bytes(self) -> int | None:
        """Capacity of the pipe to the producer process (None without one, or where unknown)."""
        return self._pipe.pipe_bytes if self._pipe is not None else None

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            self._sender.handle(item)
        self._sender.close()

    def close(self) -> None:
        """Deliver what is buffered (bounded by the send timeout), then stop the thread (and process)."""
        wait_s = self._send_timeout_ms / 1000 + 5
        if self._pipe is None:
            self._queue.put(None)
            self._thread.join(timeout=wait_s)
            return
        self._pipe.close(wait_s)
        assert self._process is not None
        self._process.join(timeout=wait_s)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
