"""Kafka producer and consumer set-up shared by every part (kafka-python).

``LogProducer`` is what a latency-sensitive server (the gateway) uses: ``offer()`` never blocks and
never raises. Records go into a bounded buffer drained by a background thread, or through a pipe into
a child process, that owns the KafkaProducer; when the buffer is full or the broker is unreachable,
records are counted as dropped / failed instead of slowing a response.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import gc
import logging
import multiprocessing
import os
import pickle
import queue
import select
import signal
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kafka import KafkaConsumer, KafkaProducer

log = logging.getLogger(__name__)

DEFAULT_COMPRESSION = "zstd"
PIPE_BYTES = 4 << 20
"""Pipe capacity asked for between a server and its producer process (Linux caps it at
``/proc/sys/fs/pipe-max-size``, 1 MiB by default for unprivileged processes)."""


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


FETCH_MAX_WAIT_MS = 100
"""How long the broker may hold a fetch that finds nothing new. Kafka's default (500 ms) is no cost
with Kafka, whose long poll answers when a record arrives; the embedded broker answers it late
instead (a record reached a polling consumer after 67 / 204 ms median / worst with 500 ms, 10 / 41 ms
with 100, 10 / 14 ms with 20). 100 ms keeps finished groups and new policy versions prompt at a fifth
of the wake-ups of 20 ms (each wake-up of kafka-python's threads takes a server's GIL: at 20 ms the
gateway's policy follower cost 8-10% of a core)."""


def make_consumer(bootstrap_servers: str, *, group_id: str | None, client_id: str = "streamrl",
                  auto_offset_reset: str = "earliest", **extra: Any) -> KafkaConsumer:
    """A consumer with manual offset commits. Callers ``assign()`` partitions themselves when they
    own offsets (the trainer), which also avoids the group-join wait of ``subscribe()``."""
    extra.setdefault("fetch_max_wait_ms", FETCH_MAX_WAIT_MS)
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
                 counts: Any) -> None:
        self.bootstrap_servers, self.compression = bootstrap_servers, compression
        self.send_timeout_ms, self.client_id, self.counts = send_timeout_ms, client_id, counts
        self.lock = threading.Lock()
        self.producer: KafkaProducer | None = None

    def _count(self, index: int, n: int = 1) -> None:
        with self.lock:
            self.counts[index] += n

    def _connect(self) -> KafkaProducer | None:
        try:
            return make_producer(self.bootstrap_servers, compression=self.compression,
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


_FRAME = struct.Struct("!I")
"""Each item on the pipe to the producer process: its pickled length, then the pickle; length 0 ends."""


def _collect_rarely() -> None:
    """Keep the producer process from stopping for full garbage collections.

    Building one record allocates thousands of short-lived objects (1,000 decoded logprobs); with the
    default thresholds that set off a full collection of the process's heap (kafka-python, msgspec,
    numpy) about every 800 records, up to 27 ms each on a 2-core box (and 2,200 young collections per
    2,300 records). The process reads nothing from the pipe meanwhile, and the pipe (1 MiB: about 9
    records of 107 KB) fills in 20 ms at 500 req/s, so the server's records wait in its backlog, which
    is when its response-time tail grew. Freezing what exists after start-up and collecting young
    objects less often (as the gateway does for itself) leaves 2 collections of under 6 ms in the same
    run; the records' own objects are freed by reference counting."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 100)


class _FrameReader:
    """The producer process's end of the pipe: a thread that empties the pipe into memory as fast as the
    parent fills it, so that whatever pauses the process's work (a slow record, kafka-python's sender
    holding the GIL, a collection) does not leave the pipe full (1 MiB where the kernel caps it: 20 ms
    of 107 KB records at 500 req/s) and the server's records waiting in its backlog. Bounded in bytes:
    when ``max_bytes`` are waiting here it stops reading, and the parent's own bound takes over.

    While records flow it polls the pipe every ``poll_s`` instead of sleeping in ``read``: a write to a
    pipe with a sleeping reader wakes the reader with the kernel's "sync" hint, which puts it on the
    writer's CPU, where it preempts the server's event loop (``bench/pipe_wakeup_bench.py``, 2-core box,
    500 writes/s of 107 KB: the writer runnable but off-CPU 644 ms in 8 s with a sleeping reader, 28 ms
    with a polling one). After ``idle_s`` without data it sleeps in ``select`` again, so an idle server
    costs nothing; the first record after a pause wakes it."""

    def __init__(self, fd: int, max_bytes: int = 64 << 20, poll_s: float = 0.002, idle_s: float = 1.0) -> None:
        self.fd, self.max_bytes, self.poll_s, self.idle_s = fd, max_bytes, poll_s, idle_s
        self.pending_bytes = 0
        self.frames: collections.deque[bytes | None] = collections.deque()
        self.cond = threading.Condition()
        threading.Thread(target=self._read, name="streamrl-log-pipe-reader", daemon=True).start()

    def _chunks(self) -> collections.abc.Iterator[bytes]:
        """What the pipe holds, as it comes, until end of file."""
        os.set_blocking(self.fd, False)
        idle_since = None
        while True:
            try:
                chunk = os.read(self.fd, 1 << 20)
            except BlockingIOError:
                now = time.monotonic()
                idle_since = idle_since or now
                if now - idle_since < self.idle_s:
                    time.sleep(self.poll_s)
                else:
                    select.select([self.fd], [], [])
                continue
            if not chunk:
                return
            idle_since = None
            yield chunk

    def _read(self) -> None:
        buffer, pos = bytearray(), 0
        try:
            for chunk in self._chunks():
                buffer += chunk
                while len(buffer) - pos >= _FRAME.size:
                    (size,) = _FRAME.unpack_from(buffer, pos)
                    if not size:
                        return
                    if len(buffer) - pos - _FRAME.size < size:
                        break
                    with memoryview(buffer) as view:  # one copy of the frame, not two
                        data = bytes(view[pos + _FRAME.size:pos + _FRAME.size + size])
                    pos += _FRAME.size + size
                    with self.cond:
                        while self.pending_bytes >= self.max_bytes:
                            self.cond.wait()
                        self.frames.append(data)
                        self.pending_bytes += size
                        self.cond.notify_all()
                del buffer[:pos]
                pos = 0
        except OSError as exc:
            log.warning("reading the pipe from the server failed: %s", exc)
        finally:  # an empty frame, the parent gone or a read error: the end
            with self.cond:
                self.frames.append(None)
                self.cond.notify_all()

    def __iter__(self) -> collections.abc.Iterator[bytes]:
        while True:
            with self.cond:
                while not self.frames:
                    self.cond.wait()
                data = self.frames.popleft()
                if data is None:
                    return
                self.pending_bytes -= len(data)
                self.cond.notify_all()
            yield data


def _child_main(conn: Any, bootstrap_servers: str, compression: str | None, send_timeout_ms: int,
                client_id: str, counts: Any) -> None:
    """The producer process: receives pickled items until an empty frame, then flushes and exits."""
    # The parent decides when to stop: a Ctrl-C or a SIGTERM sent to the whole process group must not
    # lose what is buffered here. The pipe closing (the parent gone) ends this loop too.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _collect_rarely()
    sender = _Sender(bootstrap_servers, compression, send_timeout_ms, client_id, counts)
    try:
        for data in _FrameReader(conn.fileno()):
            sender.handle(pickle.loads(data))
    finally:
        sender.close()


def _enlarge_pipe(fd: int) -> int | None:
    """Linux: ask for ``PIPE_BYTES`` of pipe buffer, or the most an unprivileged process may have, so
    that a burst of records rarely finds the pipe full. Elsewhere the default size stays.
    Returns the pipe's capacity where the platform tells it."""
    if not hasattr(fcntl, "F_SETPIPE_SZ"):
        return None
    try:
        return fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except OSError:
        with contextlib.suppress(OSError, ValueError):
            limit = int(Path("/proc/sys/fs/pipe-max-size").read_text())
            return fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, min(limit, PIPE_BYTES))
    return None


class _PipeWriter:
    """The parent's end of the pipe to the producer process, written from the caller's thread.

    A frame goes straight into the (enlarged, non-blocking) pipe when it has room, so a server's event
    loop pays one pickle and one ``write`` per call and no thread wakes up; only when the child falls
    behind do frames wait in a bounded backlog that a background thread writes out."""

    def __init__(self, conn: Any, max_buffered: int, max_buffered_bytes: int = 256 << 20) -> None:
        self.conn, self.fd, self.max_buffered = conn, conn.fileno(), max_buffered
        self.max_buffered_bytes = max_buffered_bytes
        """The backlog's bound in bytes as well as records: a record can carry a 100 KB body, so a bound
        in records alone lets the backlog of a stalled producer process grow to gigabytes."""
        self.backlog_bytes = 0
        os.set_blocking(self.fd, False)
        self.pipe_bytes = _enlarge_pipe(self.fd)
        self.backlog: collections.deque[tuple[memoryview, int]] = collections.deque()
        self.backlog_items = 0
        self.waited = 0
        self.lost = 0
        self.closing = False
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._drain, name="streamrl-log-pipe", daemon=True)
        self.thread.start()

    def put(self, item: Item) -> bool:
        """False when the backlog is full (the caller counts the drop)."""
        data = pickle.dumps(item, protocol=5)
        frame = memoryview(_FRAME.pack(len(data)) + data)
        with self.cond:
            if self.closing:
                return False
            if self.backlog:  # the pipe may have room again: write what waits, not waiting for the drain thread
                with contextlib.suppress(OSError):  # the child gone: the drain thread counts the loss
                    self._flush_backlog()
            if not self.backlog:
                try:
                    frame = frame[os.write(self.fd, frame):]
                except BlockingIOError:
                    pass
                except OSError as exc:  # the child died: nothing will read this
                    self.lost += item[3]
                    log.warning("record not handed to the producer process: %s", exc)
                    return True
                if not frame:
                    return True
            elif self.backlog_items >= self.max_buffered \
                    or self.backlog_bytes + len(frame) > self.max_buffered_bytes:
                return False
            self.backlog.append((frame, item[3]))
            self.backlog_items += item[3]
            self.backlog_bytes += len(frame)
            self.waited += item[3]
            self.cond.notify()
        return True

    def _flush_backlog(self) -> None:
        """Write waiting frames while the pipe takes them, without blocking (the lock held). Raises
        OSError when the child is gone."""
        while self.backlog:
            frame, n = self.backlog[0]
            try:
                rest = frame[os.write(self.fd, frame):]
            except BlockingIOError:
                return
            self.backlog_bytes -= len(frame) - len(rest)
            if rest:
                self.backlog[0] = (rest, n)
                return
            self.backlog.popleft()
            self.backlog_items -= n

    @property
    def buffered(self) -> int:
        return self.backlog_items

    def _drain(self) -> None:
        while True:
            with self.cond:
                while not self.backlog and not self.closing:
                    self.cond.wait()
                if not self.backlog:
                    break
            select.select([], [self.fd], [])  # wait for room, the lock released
            with self.cond:
                try:
                    self._flush_backlog()
                except OSError as exc:
                    self.lost += sum(n for _, n in self.backlog)
                    self.backlog.clear()
                    self.backlog_items = self.backlog_bytes = 0
                    log.warning("records not handed to the producer process: %s", exc)
                    break
        os.set_blocking(self.fd, True)
        with contextlib.suppress(OSError):
            os.write(self.fd, _FRAME.pack(0))
        self.conn.close()

    def close(self, timeout_s: float) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify()
        self.thread.join(timeout_s)


class LogProducer:
    """Fire-and-forget producer for servers: bounded buffer, counters, never blocks the caller.

    With ``process=True`` the KafkaProducer and the building of deferred records run in a child process
    fed through a pipe, so that neither holds the server's GIL: kafka-python batches records in Python,
    and a server's event loop should not wait for that. Without it, one background thread owns the
    KafkaProducer and drains a bounded queue. ``max_buffered`` bounds the records waiting on this side,
    ``max_buffered_bytes`` (process mode) their bytes too: what is over either is dropped and counted."""

    def __init__(self, bootstrap_servers: str, *, max_buffered: int = 100_000, max_buffered_bytes: int = 256 << 20,
                 compression: str | None = DEFAULT_COMPRESSION, send_timeout_ms: int = 10_000,
                 client_id: str = "streamrl-gateway", process: bool = False) -> None:
        self.bootstrap_servers = bootstrap_servers
        self.max_buffered = max_buffered
        self._offered = self._dropped = self._unsendable = 0
        self._send_timeout_ms = send_timeout_ms
        self._process = None
        self._pipe: _PipeWriter | None = None
        self._queue: queue.Queue[Item | None] = queue.Queue(max_buffered)
        if process:
            ctx = multiprocessing.get_context("spawn")
            self._counts: Any = ctx.Array("q", 4, lock=False)
            reader, writer = ctx.Pipe(duplex=False)
            self._process = ctx.Process(target=_child_main, name="streamrl-log-producer", daemon=True,
                                        args=(reader, bootstrap_servers, compression, send_timeout_ms, client_id,
                                              self._counts))
            self._process.start()
            reader.close()
            self._pipe = _PipeWriter(writer, max_buffered, max_buffered_bytes)
        else:
            self._counts = [0, 0, 0, 0]
            self._sender = _Sender(bootstrap_servers, compression, send_timeout_ms, client_id, self._counts)
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
                ok = self._pipe.put(item)
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
