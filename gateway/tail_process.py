"""A server's control topics, read and written in a child process of its own.

A gateway tails two one-partition topics (the policy versions, the gateways' coordination states) and writes
its own state every few seconds. Done in the gateway's process, kafka-python's threads (each consumer's long
poll, the producer's sender) took the event loop's GIL hundreds of times a second under load: the loop was off
its CPU 4-5% of the time at saturation against 1% without them (docs/gateway.md, "How it keeps overhead low").
Here one child process runs one consumer for every tailed partition and one producer; the parent's event loop
gets each batch of records from a socket it reads (an asyncio stream) and each write's offset as a future. This
module moves bytes only: what the records mean, and what a malformed one costs, is the caller's business.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import pickle
import queue
import signal
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kafka import TopicPartition

from streamrl.broker.clients import FETCH_MAX_WAIT_MS, PLAINTEXT, make_consumer, make_producer
from streamrl.broker.security import KafkaSecurity

from .frame_pipe import FRAME  # each message on the socket: its pickle's length, then the pickle

log = logging.getLogger(__name__)


Records = list[tuple[int, bytes]]
"""One poll's records of one topic: (offset, value), in offset order."""


@dataclass(frozen=True, slots=True)
class Tail:
    """Partition 0 of ``topic``, read from ``since_s`` (Unix seconds: the first record at or after it, by the
    broker's timestamp index; None: from the beginning)."""

    topic: str
    since_s: float | None = None


@dataclass(slots=True)
class _Subscriber:
    tail: Tail
    on_records: Callable[[Records], None]
    on_end: Callable[[], None] | None


class TailProcess:
    """Tails topics and writes records in a child process; callbacks and results arrive on the event loop.

    ``subscribe`` may come before or after ``start`` and before Kafka answers: the child connects (retrying
    every ``retry_s``) and then reads each tail from its start. ``on_end`` runs once, when a tail has been read
    to the end offset it had when it was first read (an empty poll at or past it)."""

    def __init__(self, bootstrap_servers: str, *, security: KafkaSecurity = PLAINTEXT,
                 client_id: str = "streamrl-tails", retry_s: float = 1.0) -> None:
        self.bootstrap_servers, self.security, self.client_id, self.retry_s = (bootstrap_servers, security,
                                                                               client_id, retry_s)
        self._subscribers: dict[str, _Subscriber] = {}
        self._writes: dict[int, asyncio.Future[int]] = {}
        self._ids = itertools.count()
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task[None] | None = None
        self._process: Any = None
        self._stopping = False

    @property
    def pid(self) -> int | None:
        """The child process's id (None before ``start``)."""
        return None if self._process is None else self._process.pid

    async def start(self) -> None:
        """Start the child (it connects to Kafka on its own time) and read what it sends."""
        ours, theirs = socket.socketpair()
        ctx = multiprocessing.get_context("spawn")
        self._process = ctx.Process(target=_child_main, name="streamrl-tails", daemon=True,
                                    args=(theirs, self.bootstrap_servers, self.security, self.client_id,
                                          self.retry_s))
        try:
            await asyncio.to_thread(self._process.start)  # spawning takes ~10 ms of the calling thread
        finally:
            theirs.close()
        reader, self._writer = await asyncio.open_connection(sock=ours)
        self._reading = asyncio.get_running_loop().create_task(self._read(reader))
        for subscriber in self._subscribers.values():
            self._send("subscribe", subscriber.tail)

    def subscribe(self, tail: Tail, on_records: Callable[[Records], None],
                  on_end: Callable[[], None] | None = None) -> None:
        """Hand every record of ``tail`` to ``on_records`` (on the event loop), from its start on."""
        if tail.topic in self._subscribers:
            raise ValueError(f"{tail.topic} is tailed already")
        self._subscribers[tail.topic] = _Subscriber(tail, on_records, on_end)
        if self._writer is not None:
            self._send("subscribe", tail)

    async def write(self, topic: str, key: bytes | None, value: bytes, timeout_s: float = 30.0) -> int:
        """Produce one record (``acks=all``) and return its offset once acknowledged (before Kafka answers, the
        record waits in the child, and one whose caller gave up is still made). Raises ``TimeoutError`` after
        ``timeout_s``, ``KafkaUnavailable`` when the send failed or the child is gone."""
        write_id = next(self._ids)
        future = self._writes[write_id] = asyncio.get_running_loop().create_future()
        try:
            self._send("write", write_id, topic, key, value)
            async with asyncio.timeout(timeout_s):
                return await future
        finally:
            self._writes.pop(write_id, None)

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the child to flush its writes and exit; killed after ``timeout_s``."""
        if self._process is None:
            return
        self._stopping = True
        with contextlib.suppress(KafkaUnavailable):
            self._send("stop")
        await asyncio.to_thread(self._process.join, timeout_s)
        if self._process.is_alive():
            self._process.kill()
            await asyncio.to_thread(self._process.join, 1.0)
        if self._reading is not None:
            self._reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reading
        if self._writer is not None:
            self._writer.close()
        self._fail_writes("the tail process stopped")
        self._process = self._writer = None

    # -- the parent's side of the socket ---------------------------------------------------------------
    def _send(self, *message: object) -> None:
        if self._writer is None or self._writer.is_closing():
            raise KafkaUnavailable("the tail process is not running")
        data = pickle.dumps(message)
        self._writer.write(FRAME.pack(len(data)) + data)  # buffered by the transport: never blocks

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                (size,) = FRAME.unpack(await reader.readexactly(FRAME.size))
                message = pickle.loads(await reader.readexactly(size))
                try:
                    self._dispatch(message)
                except Exception:  # a subscriber's bug must not stop the others' records
                    log.exception("handling %s from the tail process failed", message[0])
        except (asyncio.IncompleteReadError, ConnectionError):
            if self._stopping:
                return
            log.error("the Kafka tail process exited (code %s)",
                      self._process.exitcode if self._process is not None else None)
            self._fail_writes("the tail process exited")

    def _fail_writes(self, reason: str) -> None:
        for future in self._writes.values():
            if not future.done():
                future.set_exception(KafkaUnavailable(reason))

    def _dispatch(self, message: tuple[Any, ...]) -> None:
        kind, *rest = message
        if kind == "records":
            topic, records = rest
            self._subscribers[topic].on_records(records)
        elif kind == "end":
            on_end = self._subscribers[rest[0]].on_end
            if on_end is not None:
                on_end()
        elif kind == "written":
            write_id, offset, error = rest
            future = self._writes.get(write_id)
            if future is not None and not future.done():
                if error is None:
                    future.set_result(offset)
                else:
                    future.set_exception(KafkaUnavailable(error))


class KafkaUnavailable(ConnectionError):
    """A write the tail process could not make (the send failed, or the process is gone)."""


# -- the child process ---------------------------------------------------------------------------------------
@dataclass(slots=True)
class _Reading:
    tail: Tail
    end: int | None = None
    """The end offset when reading began; None once ``end`` was reported."""


class _Child:
    """One consumer thread (this process's main thread) and one control thread (reads the parent's messages,
    sends writes at once: a long poll must not hold a coordination state back)."""

    def __init__(self, sock: socket.socket, bootstrap_servers: str, security: KafkaSecurity, client_id: str,
                 retry_s: float) -> None:
        self.sock, self.bootstrap_servers, self.security = sock, bootstrap_servers, security
        self.client_id, self.retry_s = client_id, retry_s
        self.send_lock = threading.Lock()
        self.connecting = threading.Lock()
        self.unsent: list[tuple[int, str, bytes | None, bytes]] = []
        self.stopping = threading.Event()
        self.new_tails: queue.SimpleQueue[Tail] = queue.SimpleQueue()
        self.producer: Any = None
        self.consumer: Any = None
        self.reading: dict[TopicPartition, _Reading] = {}

    def reply(self, *message: object) -> None:
        data = pickle.dumps(message)
        with self.send_lock, contextlib.suppress(OSError):  # the parent gone: the control thread ends us
            self.sock.sendall(FRAME.pack(len(data)) + data)

    def receive(self) -> tuple[Any, ...]:
        """The parent's next message (blocking); EOFError once the parent has closed its end."""
        (size,) = FRAME.unpack(self._exactly(FRAME.size))
        return pickle.loads(self._exactly(size))

    def _exactly(self, size: int) -> bytes:
        data = bytearray()
        while len(data) < size:
            chunk = self.sock.recv(size - len(data))
            if not chunk:
                raise EOFError
            data += chunk
        return bytes(data)

    # -- control thread ------------------------------------------------------------------------------
    def control(self) -> None:
        try:
            while True:
                kind, *rest = self.receive()
                if kind == "stop":
                    break
                if kind == "subscribe":
                    self.new_tails.put(rest[0])
                elif kind == "write":
                    self.write(*rest)
        except (EOFError, OSError):
            pass  # the parent is gone
        finally:
            self.stopping.set()

    def write(self, write_id: int, topic: str, key: bytes | None, value: bytes) -> None:
        with self.connecting:  # before the producer exists, writes wait for it (the parent's timeout bounds that)
            producer = self.producer
            if producer is None:
                self.unsent.append((write_id, topic, key, value))
                return
        try:
            future = producer.send(topic, key=key, value=value)
        except Exception as exc:
            self.reply("written", write_id, None, f"{type(exc).__name__}: {exc}")
            return
        future.add_callback(lambda md: self.reply("written", write_id, md.offset, None))
        future.add_errback(lambda exc: self.reply("written", write_id, None, f"{type(exc).__name__}: {exc}"))

    # -- consumer (main) thread ----------------------------------------------------------------------
    def connect(self) -> bool:
        try:
            if self.producer is None:
                producer = make_producer(self.bootstrap_servers, security=self.security, acks="all", linger_ms=0,
                                         compression=None, client_id=self.client_id)
                with self.connecting:
                    self.producer, unsent, self.unsent = producer, self.unsent, []
                for write in unsent:
                    self.write(*write)
            if self.consumer is None:
                self.consumer = make_consumer(self.bootstrap_servers, group_id=None, security=self.security,
                                              client_id=self.client_id)
        except Exception as exc:
            log.warning("tails cannot reach Kafka (%s); retrying", exc)
            return False
        return True

    def add(self, tail: Tail) -> None:
        tp = TopicPartition(tail.topic, 0)
        consumer = self.consumer
        consumer.assign([*self.reading, tp])  # kafka-python keeps the positions of partitions still assigned
        start = None
        if tail.since_s is not None:
            with contextlib.suppress(Exception):  # a broker without timestamp lookups: read all it keeps
                found = consumer.offsets_for_times({tp: int(tail.since_s * 1000)}).get(tp)
                start = None if found is None else found.offset
        if start is None:
            consumer.seek_to_beginning(tp)
        else:
            consumer.seek(tp, start)
        try:
            end = consumer.end_offsets([tp])[tp]
        except Exception:
            end = 0
        self.reading[tp] = _Reading(tail, end)

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                self.step()
            except Exception:  # a Kafka client's surprise must not end the process: the parent relies on it
                log.exception("reading the tailed topics failed; going on in %.1fs", self.retry_s)
                self.stopping.wait(self.retry_s)

    def step(self) -> None:
        if (self.consumer is None or self.producer is None) and not self.connect():
            self.stopping.wait(self.retry_s)
            return
        if not self.reading:  # nothing to read yet: wait for the first tail
            with contextlib.suppress(queue.Empty):
                self.add(self.new_tails.get(timeout=0.2))
            return
        while not self.new_tails.empty():
            self.add(self.new_tails.get())
        batches = self.consumer.poll(timeout_ms=FETCH_MAX_WAIT_MS)
        for tp, reading in self.reading.items():
            messages = batches.get(tp)
            if messages:
                self.reply("records", tp.topic, [(m.offset, m.value) for m in messages])
            elif reading.end is not None and self.consumer.position(tp) >= reading.end:
                reading.end = None
                self.reply("end", tp.topic)

    def close(self) -> None:
        if self.consumer is not None:
            with contextlib.suppress(Exception):
                self.consumer.close()
        if self.producer is not None:
            with contextlib.suppress(Exception):
                self.producer.flush(timeout=5)
                self.producer.close(timeout=5)


def _child_main(sock: socket.socket, bootstrap_servers: str, security: KafkaSecurity, client_id: str,
                retry_s: float) -> None:
    # the parent decides when to stop: its "stop", or its end (the socket closing)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    child = _Child(sock, bootstrap_servers, security, client_id, retry_s)
    threading.Thread(target=child.control, name="tails-control", daemon=True).start()
    try:
        child.run()
    finally:
        child.close()
