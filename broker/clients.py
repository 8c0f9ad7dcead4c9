"""Kafka producer and consumer set-up shared by every part (kafka-python).

``LogProducer`` is what a latency-sensitive server (the gateway) uses: ``offer()`` never blocks and
never raises. Records go into a bounded in-memory queue drained by one background thread that owns
the KafkaProducer; when the queue is full or the broker is unreachable, records are counted as
dropped / failed instead of slowing a response.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kafka import KafkaConsumer, KafkaProducer

log = logging.getLogger(__name__)

DEFAULT_COMPRESSION = "zstd"


def make_producer(bootstrap_servers: str, *, compression: str | None = DEFAULT_COMPRESSION,
                  linger_ms: int = 5, max_block_ms: int = 60_000, acks: int | str = 1,
                  client_id: str = "streamrl", **extra: Any) -> KafkaProducer:
    """A producer tuned for many small-to-medium records: compressed batches, short linger."""
    return KafkaProducer(
        bootstrap_servers=bootstrap_servers,
        client_id=client_id,
        compression_type=compression,
        linger_ms=linger_ms,
        batch_size=1 << 20,
        max_request_size=16 << 20,
        acks=acks,
        max_block_ms=max_block_ms,
        retries=5,
        **extra,
    )


def make_consumer(bootstrap_servers: str, *, group_id: str | None, client_id: str = "streamrl",
                  auto_offset_reset: str = "earliest", **extra: Any) -> KafkaConsumer:
    """A consumer with manual offset commits. Callers ``assign()`` partitions themselves when they
    own offsets (the trainer), which also avoids the group-join wait of ``subscribe()``."""
    return KafkaConsumer(
        bootstrap_servers=bootstrap_servers,
        group_id=group_id,
        client_id=client_id,
        enable_auto_commit=False,
        auto_offset_reset=auto_offset_reset,
        max_partition_fetch_bytes=16 << 20,
        fetch_max_bytes=64 << 20,
        **extra,
    )


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

    @property
    def undelivered(self) -> int:
        return self.failed + self.dropped


Build = Callable[[], list[tuple[bytes | None, bytes]]]
"""Makes (key, value) pairs on the producer thread, so encoding stays off the caller's thread."""


class LogProducer:
    """Fire-and-forget producer for servers: bounded buffer, background thread, counters."""

    def __init__(self, bootstrap_servers: str, *, max_buffered: int = 100_000,
                 compression: str | None = DEFAULT_COMPRESSION, send_timeout_ms: int = 10_000,
                 client_id: str = "streamrl-gateway") -> None:
        self.bootstrap_servers = bootstrap_servers
        self.stats = ProducerStats()
        self._queue: queue.Queue[tuple[str, bytes | None, bytes | Build, int] | None] = queue.Queue(max_buffered)
        self._compression = compression
        self._send_timeout_ms = send_timeout_ms
        self._client_id = client_id
        self._lock = threading.Lock()
        self._producer: KafkaProducer | None = None
        self._thread = threading.Thread(target=self._run, name="streamrl-log-producer", daemon=True)
        self._thread.start()

    def offer(self, topic: str, key: bytes | None, value: bytes) -> bool:
        """Queue a record; False (and counted as dropped) when the buffer is full. Never blocks."""
        return self._put((topic, key, value, 1))

    def offer_deferred(self, topic: str, build: Build, count: int) -> bool:
        """Queue ``count`` records whose bytes ``build()`` makes later, on the producer thread.
        If ``build`` raises, none of them is sent and all are counted as invalid."""
        return self._put((topic, None, build, count))

    def _put(self, item: tuple[str, bytes | None, bytes | Build, int]) -> bool:
        n = item[3]
        self.stats.offered += n
        try:
            self._queue.put_nowait(item)
            return True
        except queue.Full:
            self.stats.dropped += n
            return False

    @property
    def buffered(self) -> int:
        return self._queue.qsize()

    @property
    def capacity(self) -> int:
        return self._queue.maxsize

    def _connect(self) -> KafkaProducer | None:
        try:
            return make_producer(self.bootstrap_servers, compression=self._compression,
                                 max_block_ms=self._send_timeout_ms, request_timeout_ms=self._send_timeout_ms,
                                 delivery_timeout_ms=self._send_timeout_ms + 5_000, client_id=self._client_id)
        except Exception as exc:  # broker down at start: keep serving, retry on the next record
            log.warning("cannot connect producer to %s: %s", self.bootstrap_servers, exc)
            return None

    def _on_ok(self, nbytes: int):
        def ok(_meta: Any) -> None:
            with self._lock:
                self.stats.delivered += 1
                self.stats.bytes_delivered += nbytes
        return ok

    def _on_err(self, exc: BaseException, n: int = 1) -> None:
        with self._lock:
            self.stats.failed += n
        log.debug("record not delivered: %s", exc)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                break
            topic, key, value, count = item
            if callable(value):
                try:
                    pairs = value()
                except Exception as exc:
                    with self._lock:
                        self.stats.invalid += count
                    log.warning("record not built: %s", exc)
                    continue
            else:
                pairs = [(key, value)]
            if self._producer is None:
                self._producer = self._connect()
                if self._producer is None:
                    self._on_err(ConnectionError("broker unreachable"), len(pairs))
                    time.sleep(0.2)
                    continue
            for k, v in pairs:
                try:
                    fut = self._producer.send(topic, key=k, value=v)
                    fut.add_callback(self._on_ok(len(v))).add_errback(self._on_err)
                except Exception as exc:  # metadata timeout, buffer exhausted in the client
                    self._on_err(exc)
        if self._producer is not None:
            try:
                self._producer.flush(timeout=self._send_timeout_ms / 1000)
            except Exception as exc:  # broker gone: what is left is counted by the errbacks
                log.warning("records left undelivered at close: %s", exc)
            try:
                self._producer.close(timeout=0)
            except Exception as exc:
                log.debug("producer close: %s", exc)

    def close(self) -> None:
        """Deliver what is buffered (bounded by the send timeout), then stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout=self._send_timeout_ms / 1000 + 5)
