"""``LogProducer``: what a latency-sensitive server (the gateway) logs through. ``offer()`` never blocks
and never raises. Records go into a bounded buffer drained by a background thread, or through a pipe
(``frame_pipe``) into a child process, that owns the ``Delivery`` (``delivery.py``): the Kafka producer,
and the spool on disk that keeps records while the broker cannot take them. A full buffer, or a full
spool, drops records and counts them instead of slowing a response.
"""

from __future__ import annotations

import atexit
import functools
import gc
import logging
import multiprocessing
import os
import pickle
import queue
import signal
import struct
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from streamrl.broker.clients import DEFAULT_COMPRESSION, PLAINTEXT
from streamrl.broker.security import KafkaSecurity
from streamrl.gateway.frame_pipe import FrameReader, PipeWriter

from .delivery import (
    BYTES,
    DELIVERED,
    FAILED,
    INVALID,
    NCOUNTS,
    REPLAYED,
    SPOOL_BYTES,
    SPOOL_CORRUPT,
    SPOOL_DROPPED,
    SPOOL_FULL,
    SPOOL_RECORDS,
    SPOOLED,
    SPOOLING,
    Delivery,
)
from .kafka_producers import ProducerClient, RecordProducer, connect
from .spool import Spool

log = logging.getLogger(__name__)


@dataclass
class ProducerStats:
    offered: int = 0
    delivered: int = 0
    """Acknowledged by Kafka (straight, or replayed from the spool)."""
    failed: int = 0
    """Not acknowledged and not spooled (no spool configured; or lost with a dead producer process)."""
    dropped: int = 0
    """Refused at the door because the buffer was full."""
    invalid: int = 0
    """Deferred records whose value could not be built (nothing was sent for them)."""
    bytes_delivered: int = 0
    waited: int = 0
    """Records that found the pipe to the producer process full and waited in the backlog (a producer
    process falling behind; each such wait wakes a thread in the server)."""
    spooled: int = 0
    """Written to the spool because Kafka could not take them (then replayed from there)."""
    replayed: int = 0
    """Delivered from the spool."""
    spool_dropped: int = 0
    """Lost because the spool was full (or its disk failed)."""
    spool_bytes: int = 0
    spool_records: int = 0
    """Records in the spool waiting for Kafka."""
    spool_full: bool = False
    spooling: bool = False
    """Records go to the spool now (Kafka not taking them, or the spool not yet drained)."""
    spool_corrupt: int = 0
    """Corrupt regions of the spool skipped at start (frames that failed their checksum)."""

    @property
    def undelivered(self) -> int:
        return self.failed + self.dropped + self.spool_dropped

    @classmethod
    def from_counts(cls, c: Any, **fields: Any) -> ProducerStats:
        """From a ``Delivery``'s counters."""
        return cls(delivered=c[DELIVERED], bytes_delivered=c[BYTES], spooled=c[SPOOLED], replayed=c[REPLAYED],
                   spool_dropped=c[SPOOL_DROPPED], spool_bytes=c[SPOOL_BYTES], spool_records=c[SPOOL_RECORDS],
                   spool_full=bool(c[SPOOL_FULL]), spool_corrupt=c[SPOOL_CORRUPT], spooling=bool(c[SPOOLING]),
                   **fields)


Build = Callable[[], list[tuple[bytes | None, bytes]]]
"""Makes (key, value) pairs on the producer's side, so encoding stays off the caller's thread. With
``LogProducer(process=True)`` it must be picklable (e.g. a ``functools.partial`` of a module-level function)."""

Item = tuple[str, bytes | None, bytes | Build, int]

PartsBuild = Callable[..., list[tuple[bytes | None, bytes]]]
"""``build(*parts)`` makes (key, value) pairs from byte strings (``LogProducer.offer_parts``): a module-level
function the server declares up front (``LogProducer(builders=...)``); a frame of parts names it by its place
in that list, and the producer process gets the list itself at its start (pickled by reference)."""

_PARTS = 0x50
"""First byte of a frame of parts (a pickle frame's first byte is the PROTO opcode, 0x80)."""
_WAITING_PARTS = 0x51
"""First byte of a frame of parts whose last part is the key of the side input they wait for (``Waiter``)."""
_PARTS_HEAD = struct.Struct("<BIHHB")
"""A frame of parts: kind, records, topic length, the builder's place in the declared builders, number of
parts; then each part's length (u32), the topic and the parts."""


def check_builders(builders: Sequence[PartsBuild]) -> tuple[PartsBuild, ...]:
    """The builders as the producer process will get them; ``ValueError`` for one it could not (a lambda, a
    closure, a bound method: pickle passes functions by their module and name)."""
    for build in builders:
        try:
            same = pickle.loads(pickle.dumps(build)) is build
        except Exception:
            same = False
        if not same:
            raise ValueError(f"{build!r} is not a module-level function")
    if len(builders) > 0xFFFF:
        raise ValueError("too many builders")
    return tuple(builders)


@dataclass(frozen=True, slots=True)
class Waiting:
    """Records that cannot be built before a side input arrives in the producer (``offer_parts(wait_for=...)``):
    the ``Waiter`` builds them with ``build(*parts, *side_input)`` once it has it."""

    topic: str
    build: PartsBuild
    parts: tuple[bytes, ...]
    count: int
    key: bytes


class Waiter(Protocol):
    """Joins ``Waiting`` records with side inputs that reach the producer some other way (the gateway's
    deferred captures: ``gateway/recording/capture_stream.py``). Made in the producer (process or thread) by
    ``WaiterSpec``; hands finished items to ``deliver`` from any thread, and counts records whose input never
    came as invalid."""

    def offer(self, waiting: Waiting) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class WaiterSpec:
    """How the producer makes its ``Waiter``: ``factory`` (a module-level function, passed to the producer
    process by reference) is called as ``factory(deliver, counts, *args)``; ``args`` must be picklable."""

    factory: Callable[..., Waiter]
    args: tuple[Any, ...] = ()

    def make(self, deliver: Callable[[Item], None], counts: Any) -> Waiter:
        return self.factory(deliver, counts, *self.args)


@functools.cache
def _parts_head(n: int) -> struct.Struct:
    """``_PARTS_HEAD`` and the lengths of ``n`` parts, packed at once."""
    return struct.Struct(_PARTS_HEAD.format + f"{n}I")


def parts_frame(topic: str, builder: int, parts: Sequence[bytes], count: int,
                wait_for: bytes | None = None) -> tuple[bytes, ...]:
    """The chunks of one frame of parts (``builder``: its place in the declared builders), to be written as
    they are (``PipeWriter.put_chunks``)."""
    t = topic.encode()
    kind = _PARTS
    if wait_for is not None:
        kind, parts = _WAITING_PARTS, (*parts, wait_for)
    head = _parts_head(len(parts)).pack(kind, count, len(t), builder, len(parts), *map(len, parts))
    return (head + t, *parts)


def decode_item(data: bytes, builders: Sequence[PartsBuild] = ()) -> Item | Waiting:
    """A frame from the server: a pickled item, or parts with the builder (of ``builders``) that turns them
    into records. ``ValueError`` (or a pickle error) for a frame that is neither."""
    if data[:1] not in (bytes((_PARTS,)), bytes((_WAITING_PARTS,))):
        return pickle.loads(data)
    n = _PARTS_HEAD.unpack_from(data)[-1]
    head = _parts_head(n)
    kind, count, topic_len, builder, _, *sizes = head.unpack_from(data)
    pos = head.size
    topic = data[pos:pos + topic_len].decode()
    pos += topic_len
    if pos + sum(sizes) != len(data):
        raise ValueError(f"a frame of parts of {len(data)} bytes does not hold its {n} parts")
    if builder >= len(builders):
        raise ValueError(f"no builder #{builder} among the {len(builders)} declared")
    build = builders[builder]
    parts = []
    for size in sizes:
        parts.append(data[pos:pos + size])
        pos += size
    if kind == _WAITING_PARTS:
        return Waiting(topic, build, tuple(parts[:-1]), count, parts[-1])
    return topic, None, functools.partial(build, *parts), count


@dataclass(frozen=True)
class SenderConfig:
    """What the producer side needs, picklable for the producer process."""

    bootstrap_servers: str
    compression: str | None
    send_timeout_ms: int
    client_id: str
    spool_dir: str | None = None
    """Where records wait when Kafka cannot take them (None: they are counted as failed)."""
    spool_max_bytes: int = 1 << 30
    spool_after_ms: int = 2_000
    spool_sync_interval_s: float = 1.0
    spool_lock_wait_s: float = 30.0
    """How long to wait for the spool directory held by another process (a predecessor still
    delivering what it had after its server died)."""
    security: KafkaSecurity = PLAINTEXT
    client: ProducerClient = "librdkafka"
    """The Kafka client records are sent through (``kafka_producers.py``)."""

    def connect(self, linger_ms: int = 20) -> RecordProducer:
        """A connected producer set up for ordered, at-least-once records (``kafka_producers.py``)."""
        return connect(self.client, self.bootstrap_servers, security=self.security, compression=self.compression,
                       linger_ms=linger_ms, send_timeout_ms=self.send_timeout_ms, client_id=self.client_id)

    def delivery(self, counts: Any, subdir: str, linger_ms: int = 20) -> Delivery:
        spool = None
        if self.spool_dir is not None:
            spool = Spool(Path(self.spool_dir) / subdir, max_bytes=self.spool_max_bytes,
                          lock_wait_s=self.spool_lock_wait_s)
        return Delivery(functools.partial(self.connect, linger_ms), counts, spool,
                        spool_after_s=self.spool_after_ms / 1000, send_timeout_s=self.send_timeout_ms / 1000,
                        sync_interval_s=self.spool_sync_interval_s)


class _Sender:
    """Builds deferred records and hands them to the ``Delivery`` (Kafka, or the spool), which counts
    outcomes into ``counts`` (a plain list in a thread, shared memory in a child process); ``Waiting`` records
    go to the ``Waiter``, which hands them back here (from its own threads: one lock for the delivery)."""

    def __init__(self, config: SenderConfig, counts: Any, waiter: WaiterSpec | None = None) -> None:
        self.config, self.counts = config, counts
        self.delivery = config.delivery(counts, "completions")
        self.lock = threading.Lock()
        self.waiter = waiter.make(self.handle, counts) if waiter is not None else None

    def handle(self, item: Item | Waiting) -> None:
        if isinstance(item, Waiting):
            if self.waiter is None:
                self.counts[INVALID] += item.count
                log.warning("records waiting for a side input, but this producer has no waiter")
            else:
                self.waiter.offer(item)
            return
        with self.lock:
            self._handle(item)

    def _handle(self, item: Item) -> None:
        topic, key, value, count = item
        if callable(value):
            try:
                pairs = value()
            except Exception as exc:
                self.counts[INVALID] += count
                log.warning("record not built: %s", exc)
                return
        else:
            pairs = [(key, value)]
        self.delivery.put_many([(topic, k, v) for k, v in pairs])

    def close(self) -> None:
        if self.waiter is not None:
            self.waiter.close()  # what it still holds is delivered (or counted) first
        self.delivery.close(self.config.send_timeout_ms / 1000)


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


def background_priority() -> bool:
    """Run this process under ``SCHED_BATCH`` (Linux; any user may choose it): its threads then never preempt
    a running thread when they wake up, they wait for the scheduler's tick or an idle CPU.

    The producer process's work is throughput, never latency (records wait in the pipe and the backlog
    anyway), while every wake-up of its threads (the pipe reader's poll, kafka-python's network thread on a
    broker's answer) could land on the CPU of the server's event loop and preempt it: with logging on, the
    gateway's event loop was runnable but off its CPU for 37-93 ms per 8 s phase against 0.3 ms with
    logging off, and a few such stalls make the latency p99 (docs/history/benchmarks-2026-12.md, "Gateway overhead").
    Returns whether the policy was set."""
    if not hasattr(os, "sched_setscheduler"):
        return False
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except OSError as exc:
        log.debug("SCHED_BATCH not set: %s", exc)
        return False
    return True


def _child_main(conn: Any, config: SenderConfig, counts: Any, waiter: WaiterSpec | None = None,
                ready: Any = None, builders: tuple[PartsBuild, ...] = ()) -> None:
    """The producer process: receives pickled items until an empty frame, then flushes and exits. ``ready`` is
    set once it reads the pipe."""
    # The parent decides when to stop: a Ctrl-C or a SIGTERM sent to the whole process group must not
    # lose what is buffered here. The pipe closing (the parent gone) ends this loop too.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    background_priority()  # before any thread starts: they inherit it
    _collect_rarely()
    sender = _Sender(config, counts, waiter)
    if ready is not None:
        ready.set()
    try:
        for data in FrameReader(conn.fileno()):
            try:
                item = decode_item(data, builders)
            except Exception as exc:  # a bug in the server: one frame lost and counted, never the process
                counts[INVALID] += 1
                log.warning("unreadable frame from the server: %s", exc)
                continue
            sender.handle(item)
    finally:
        sender.close()


class LogProducer:
    """Fire-and-forget producer for servers: bounded buffer, counters, never blocks the caller.

    With ``process=True`` the Kafka producer and the building of deferred records run in a child process
    fed through a pipe, so that neither holds the server's GIL (nor takes the server's CPU time: the
    records' decoding and encoding are Python). Without it, one background thread owns the producer and
    drains a bounded queue. ``max_buffered`` bounds the records waiting on this side,
    ``max_buffered_bytes`` (process mode) their bytes too: what is over either is dropped and counted."""

    def __init__(self, bootstrap_servers: str, *, max_buffered: int = 100_000, max_buffered_bytes: int = 256 << 20,
                 compression: str | None = DEFAULT_COMPRESSION, send_timeout_ms: int = 10_000,
                 client_id: str = "streamrl-gateway", process: bool = False, spool_dir: str | Path | None = None,
                 spool_max_bytes: int = 1 << 30, spool_after_ms: int = 2_000,
                 security: KafkaSecurity = PLAINTEXT, waiter: WaiterSpec | None = None,
                 client: ProducerClient = "librdkafka", builders: Sequence[PartsBuild] = ()) -> None:
        self.bootstrap_servers, self.security = bootstrap_servers, security
        self.config = config = SenderConfig(bootstrap_servers, compression, send_timeout_ms, client_id,
                                            None if spool_dir is None else str(spool_dir), spool_max_bytes,
                                            spool_after_ms, security=security, client=client)
        self.max_buffered = max_buffered
        self._offered = self._dropped = self._unsendable = 0
        self._send_timeout_ms = send_timeout_ms
        self._process = None
        self._closed = False
        self._pipe: PipeWriter | None = None
        declared = check_builders(builders)
        self._builders: dict[PartsBuild, int] = {b: i for i, b in enumerate(declared)}
        self._queue: queue.Queue[Item | Waiting | None] = queue.Queue(max_buffered)
        if process:
            ctx = multiprocessing.get_context("spawn")
            self._counts: Any = ctx.Array("q", NCOUNTS, lock=False)
            reader, writer = ctx.Pipe(duplex=False)
            self._ready: Any = ctx.Event()
            self._process = ctx.Process(target=_child_main, name="streamrl-log-producer", daemon=True,
                                        args=(reader, config, self._counts, waiter, self._ready, declared))
            self._process.start()
            reader.close()
            self._pipe = PipeWriter(writer, max_buffered, max_buffered_bytes)
            # A producer never closed must not hang its program's exit: multiprocessing's own exit handler
            # joins daemon children after a SIGTERM this child ignores, while the pipe it reads stays open.
            # Registered after ``start`` (which registers that handler), so it runs first (atexit is LIFO).
            self._close_at_exit = _closer(self)
            atexit.register(self._close_at_exit)
        else:
            self._counts = [0] * NCOUNTS
            self._sender = _Sender(config, self._counts, waiter)
            self._thread = threading.Thread(target=self._run, name="streamrl-log-producer", daemon=True)
            self._thread.start()

    def wait_ready(self, timeout_s: float) -> bool:
        """Block until the producer process reads the pipe (its interpreter started, its modules imported: about
        a second of a CPU), or ``timeout_s``; True if it does. A server that takes load before then shares the
        host with that start-up: on the H200 host a fresh gateway's first second under load had requests over
        10 ms (up to 86 ms) that later seconds never had (docs/gateway.md, "How it keeps overhead low")."""
        return True if self._process is None else self._ready.wait(timeout_s)

    @property
    def stats(self) -> ProducerStats:
        c = self._counts
        lost, waited = (self._pipe.lost, self._pipe.waited) if self._pipe is not None else (0, 0)
        return ProducerStats.from_counts(c, offered=self._offered, failed=c[FAILED] + lost, dropped=self._dropped,
                                         invalid=c[INVALID] + self._unsendable, waited=waited)

    def offer(self, topic: str, key: bytes | None, value: bytes) -> bool:
        """Queue a record; False (and counted as dropped) when the buffer is full. Never blocks."""
        return self._put((topic, key, value, 1))

    def offer_deferred(self, topic: str, build: Build, count: int) -> bool:
        """Queue ``count`` records whose bytes ``build()`` makes later, off the caller's thread.
        If ``build`` raises, none of them is sent and all are counted as invalid."""
        return self._put((topic, None, build, count))

    def offer_parts(self, topic: str, build: PartsBuild, parts: Sequence[bytes], count: int,
                    wait_for: bytes | None = None) -> bool:
        """Queue ``count`` records that ``build(*parts)`` makes later, off the caller's thread, like
        ``offer_deferred``; the parts travel to the producer process as they are, beside the builder's place
        in ``builders``, which costs the caller a fraction of pickling them (a gateway call's body and capture:
        14 KB). In a producer process ``build`` must be one of the ``builders`` it was made with (else the
        records are refused, counted invalid); if it raises, the records are counted as invalid.
        With ``wait_for``, the producer's ``Waiter`` builds them once the side input of that key is in
        (``build(*parts, *side_input)``)."""
        if self._pipe is None:
            if wait_for is not None:
                return self._put(Waiting(topic, build, tuple(parts), count, wait_for))  # type: ignore[arg-type]
            return self._put((topic, None, functools.partial(build, *parts), count))
        self._offered += count
        builder = self._builders.get(build)
        if builder is None:
            self._unsendable += count
            log.warning("records not handed to the producer process: %r is not among its declared builders", build)
            return False
        if not self._pipe.put_chunks(parts_frame(topic, builder, parts, count, wait_for), count):
            self._dropped += count
            return False
        return True

    def _put(self, item: Item | Waiting) -> bool:
        n = item.count if isinstance(item, Waiting) else item[3]
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
        """Items waiting on this side (not yet in the pipe or the Kafka producer)."""
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
        """Deliver what is buffered (bounded by the send timeout), then stop the thread (and process).
        Only the first call does anything; a producer process still open at the program's exit is closed then."""
        if self._closed:
            return
        self._closed = True
        wait_s = self._send_timeout_ms / 1000 + 5
        if self._pipe is None:
            self._queue.put(None)
            self._thread.join(timeout=wait_s)
            return
        atexit.unregister(self._close_at_exit)
        self._pipe.close(wait_s)
        assert self._process is not None
        self._process.join(timeout=wait_s)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()


def _closer(producer: LogProducer) -> Callable[[], None]:
    """``producer.close`` for ``atexit``, holding the producer weakly (a producer dropped unclosed is collected,
    its pipe closed, and the child drains and exits on its own)."""
    ref = weakref.ref(producer)

    def close() -> None:
        if (alive := ref()) is not None:
            alive.close()
    return close
