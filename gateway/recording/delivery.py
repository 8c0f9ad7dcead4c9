"""``Delivery``: records to Kafka in the order given, through the spool when Kafka cannot take them.

While Kafka acknowledges records, they go straight to the Kafka client (``kafka_producers.py``: acks=all,
one request in flight per connection, so a retry cannot reorder a partition) and the spool is not touched. When a send
fails, or the oldest record waits more than ``spool_after_s`` for its acknowledgement (broker down,
slow, topic missing), every record not yet acknowledged goes into the spool in the order it was given,
the producer is dropped, and every later record is appended to the spool behind them. A thread replays
the spool in order, batch by batch, and moves its cursor once Kafka acknowledged a batch; when the spool
is empty, records go straight to Kafka again. So a key's records (one partition) reach Kafka in the
order given. Delivery is at least once: a record whose acknowledgement was outstanding when Kafka
failed, or that was delivered from the spool just before the process died (cursor not yet written),
is delivered again. Downstream the trainer ignores such duplicates (``trainer/assembler.py``: same
request id and choice, or a second reward for a trajectory, identical here).

A record given with a ``durable`` future has it resolved once the record is durable: acknowledged by
Kafka, or appended to the spool and fsynced. Other spooled records are fsynced every
``sync_interval_s`` (they survive a kill of the process at once: the kernel holds what was written).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable, MutableSequence
from concurrent.futures import Future, InvalidStateError

from .kafka_producers import RecordProducer
from .spool import Spool, SpoolFull, SpoolRecord

log = logging.getLogger(__name__)

(DELIVERED, FAILED, INVALID, BYTES, SPOOLED, REPLAYED, SPOOL_DROPPED, SPOOL_BYTES, SPOOL_RECORDS, SPOOL_FULL,
 SPOOL_CORRUPT, SPOOLING, NCOUNTS) = range(13)
"""Indices of the counters a ``Delivery`` keeps (a list, or shared memory read by a parent process).
``SPOOL_*`` from ``SPOOL_BYTES`` on are gauges."""


class NotDurable(Exception):
    """A record given with a ``durable`` future could be neither delivered nor spooled."""


class Delivery:
    """Owns the Kafka producer and the spool of one process. ``put`` is called from one thread (never
    blocks for long: a spooled record is one ``write``, a durable one an fsync too); a thread of its own
    watches acknowledgements, switches to the spool and replays it."""

    def __init__(self, connect: Callable[[], RecordProducer], counts: MutableSequence[int], spool: Spool | None,
                 *, spool_after_s: float = 2.0, send_timeout_s: float = 10.0, sync_interval_s: float = 1.0,
                 replay_batch: int = 500) -> None:
        self.connect, self.counts, self.spool = connect, counts, spool
        self.spool_after_s, self.send_timeout_s = spool_after_s, send_timeout_s
        self.sync_interval_s, self.replay_batch = sync_interval_s, replay_batch
        self.lock = threading.Lock()
        """Orders ``put`` against the switch to the spool and back."""
        self.count_lock = threading.Lock()
        self.producer: RecordProducer | None = None
        self.gen = 0
        """Bumped at each switch to the spool: late callbacks of a dropped producer are ignored."""
        self.seq = 0
        self.unacked: dict[int, tuple[SpoolRecord, Future | None, float]] = {}
        """Records given to the producer and not acknowledged yet, in the order given."""
        self.spooling = spool is not None
        """Records go to the spool (start-up included: what a previous run left is delivered first)."""
        self.outage = spool is not None and not spool.empty
        """The spool holds records Kafka did not take (an outage, or a run that ended before delivering them):
        its drain is worth a warning; the start-up's own first records passing through it are not."""
        if self.outage:
            log.warning("spool %s holds %d records an earlier run did not deliver: they go to Kafka first",
                        spool.dir, spool.records)
        self.trouble = threading.Event()
        self.closing = threading.Event()
        self._warned_full = 0.0
        self._last_connect_error = ""
        self._gauges()
        if spool is None:  # nowhere to keep records until a producer is there: connect now
            self.producer = self._connect()
        self.thread = threading.Thread(target=self._run, name="streamrl-delivery", daemon=True)
        self.thread.start()

    # -- counting -----------------------------------------------------------------------------------
    def _count(self, index: int, n: int = 1) -> None:
        with self.count_lock:
            self.counts[index] += n

    def _gauges(self) -> None:
        s = self.spool
        if s is not None:
            self.counts[SPOOL_BYTES], self.counts[SPOOL_RECORDS] = s.bytes, s.records
            self.counts[SPOOL_FULL], self.counts[SPOOL_CORRUPT] = int(s.full), s.corrupt
            self.counts[SPOOLING] = int(self.spooling)

    # -- the caller's side ----------------------------------------------------------------------------
    def put(self, topic: str, key: bytes | None, value: bytes) -> None:
        """Deliver one record (fire and forget: the outcome is counted)."""
        self.put_many([(topic, key, value)])

    def put_many(self, records: list[tuple[str, bytes | None, bytes]], durable: bool = False) -> list[Future]:
        """Deliver records in order. With ``durable``, one future per record, resolved with True once it
        is durable (acknowledged by Kafka, or fsynced in the spool), or failed with ``NotDurable``; spooled
        together, they cost one fsync."""
        now = int(time.time() * 1000)
        entries = [(SpoolRecord(t, k, v, now), Future() if durable else None) for t, k, v in records]
        sends = []
        with self.lock:
            if self.spooling:
                self._to_spool(entries)
                return [d for _, d in entries if d is not None]
            if self.producer is None:  # no spool, and no broker: nowhere to keep them
                self._count(FAILED, len(entries))
                for _, d in entries:
                    _fail(d, "Kafka unreachable and no spool")
                self.trouble.set()
                return [d for _, d in entries if d is not None]
            gen, producer, started = self.gen, self.producer, time.monotonic()
            for entry in entries:
                self.unacked[self.seq] = (*entry, started)
                sends.append((self.seq, entry[0]))
                self.seq += 1
        for seq, rec in sends:
            try:
                producer.send(rec.topic, rec.key, rec.value, rec.timestamp_ms,
                              functools.partial(self._answered, seq, gen))
            except Exception as exc:  # metadata timeout, producer closed by a switch, buffer exhausted
                self._answered(seq, gen, exc)
        return [d for _, d in entries if d is not None]

    def _answered(self, seq: int, gen: int, exc: BaseException | None) -> None:
        if exc is None:
            self._ok(seq)
        else:
            self._err(seq, gen, exc)

    def _ok(self, seq: int) -> None:
        entry = self.unacked.pop(seq, None)
        if entry is None:  # already moved to the spool by a switch: it will be delivered again
            return
        rec, durable, _ = entry
        with self.count_lock:
            self.counts[DELIVERED] += 1
            self.counts[BYTES] += len(rec.value)
        _resolve(durable)

    def _err(self, seq: int, gen: int, exc: BaseException) -> None:
        if gen != self.gen:
            return
        log.debug("record not acknowledged: %s", exc)
        if self.spool is None:
            entry = self.unacked.pop(seq, None)
            if entry is not None:
                self._count(FAILED)
                _fail(entry[1], f"not acknowledged by Kafka: {exc}")
        self.trouble.set()

    def _to_spool(self, entries: list[tuple[SpoolRecord, Future | None]]) -> None:
        """Append (called with ``self.lock`` held, so order is kept); fsync when a caller waits for it."""
        assert self.spool is not None
        sync = any(d is not None for _, d in entries)
        try:
            self.spool.append([r for r, _ in entries], sync=sync)
        except (SpoolFull, OSError) as exc:
            self._count(SPOOL_DROPPED, len(entries))
            self.counts[SPOOL_FULL] = 1
            now = time.monotonic()
            if now - self._warned_full > 5:
                self._warned_full = now
                log.error("RECORDS DROPPED: %s (dropped so far: %d)", exc, self.counts[SPOOL_DROPPED])
            for _, d in entries:
                _fail(d, f"spool full or unwritable: {exc}")
            self._gauges()
            return
        self._count(SPOOLED, len(entries))
        self._gauges()
        for _, d in entries:
            _resolve(d)

    # -- the delivery thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        last_sync = time.monotonic()
        while not self.closing.is_set():
            try:
                self._step()
            except Exception:  # a bug here must not stop delivery for good
                log.exception("delivery step failed")
                self.closing.wait(1.0)
            if self.spool is not None and time.monotonic() - last_sync >= self.sync_interval_s:
                self.spool.sync()
                last_sync = time.monotonic()
            self._gauges()

    def _step(self) -> None:
        with self.lock:
            spooling = self.spooling
        if spooling:
            if not self._replay():
                self.closing.wait(0.5)  # Kafka still unreachable: try again soon
            return
        self.trouble.wait(0.1)
        if self.producer is None and self.spool is None:
            self._reconnect()
            return
        if self.trouble.is_set() or self._oldest_age() > self.spool_after_s:
            self._switch()

    def _oldest_age(self) -> float:
        try:
            return time.monotonic() - next(iter(self.unacked.values()))[2]
        except (StopIteration, RuntimeError):
            return 0.0

    def _reconnect(self) -> None:
        producer = self._connect()
        if producer is None:
            self.closing.wait(0.5)
            return
        with self.lock:
            self.producer = producer
            self.trouble.clear()

    def _connect(self) -> RecordProducer | None:
        try:
            return self.connect()
        except Exception as exc:  # said once per cause: a wrong setting or file must not hide among the retries
            why = f"{type(exc).__name__}: {exc}"
            (log.debug if why == self._last_connect_error else log.warning)("cannot connect a producer: %s", why)
            self._last_connect_error = why
            return None

    def _switch(self) -> None:
        """Kafka is not taking records: what it has not acknowledged goes into the spool, in order, and
        so does everything after it until the spool is drained. (Without a spool: counted as failed.)"""
        with self.lock:
            self.gen += 1
            entries = [(r, d) for r, d, _ in self.unacked.values()]
            self.unacked.clear()
            old, self.producer = self.producer, None
            self.trouble.clear()
            if self.spool is not None:
                self.spooling = self.outage = True
                if entries:
                    self._to_spool(entries)
                log.warning("Kafka is not taking records: spooling to %s (%d records moved there)", self.spool.dir,
                            len(entries))
            else:
                self._count(FAILED, len(entries))
                for _, d in entries:
                    _fail(d, "not acknowledged by Kafka")
        _close(old)

    def _replay(self) -> bool:
        """Deliver the next batch of the spool; switch back to Kafka when it is empty. False when Kafka
        did not take the batch (it is read again next time)."""
        assert self.spool is not None
        if self.producer is None:
            self.producer = self._connect()
            if self.producer is None:
                return False
        recs, pos = self.spool.read(max_records=self.replay_batch)
        if not recs:
            with self.lock:
                if self.spool.empty:  # (puts append under this lock: nothing can slip in between)
                    if self.spooling and self.outage:
                        log.warning("spool %s drained: records go straight to Kafka again", self.spool.dir)
                    elif self.spooling:
                        log.info("Kafka takes records: they go straight to it (spool %s empty)", self.spool.dir)
                    self.spooling = self.outage = False
                    self.trouble.clear()
            return True
        answers = _Answers(len(recs))
        try:
            for r in recs:
                self.producer.send(r.topic, r.key, r.value, r.timestamp_ms, answers.done)
            self.producer.flush(self.send_timeout_s)
            ok = answers.all_acknowledged(1.0)
        except Exception as exc:
            log.debug("replay batch not delivered: %s", exc)
            ok = False
        if not ok:
            self.spool.rewind()
            _close(self.producer)
            self.producer = None
            return False
        self.spool.commit(pos, len(recs))
        with self.count_lock:
            self.counts[REPLAYED] += len(recs)
            self.counts[DELIVERED] += len(recs)
            self.counts[BYTES] += sum(len(r.value) for r in recs)
        return True

    # -- stopping -------------------------------------------------------------------------------------
    def close(self, timeout_s: float) -> None:
        """Wait (up to ``timeout_s``) for Kafka to acknowledge what it was given; what is still
        unacknowledged then goes into the spool, which keeps what it holds for the next start."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.unacked:
            if self.closing.wait(0.05):
                break
        self.closing.set()
        self.thread.join(timeout=max(deadline - time.monotonic(), 0) + self.send_timeout_s + 5)
        if self.unacked:
            if self.spool is not None:
                self._switch()
            else:
                with self.lock:
                    left = len(self.unacked)
                    self.unacked.clear()
                self._count(FAILED, left)
        _close(self.producer, force=self.spool is not None)
        self.producer = None
        if self.spool is not None:
            self._gauges()
            self.spool.close()


def _resolve(fut: Future | None) -> None:
    if fut is not None:
        with contextlib.suppress(InvalidStateError):  # (delivered and spooled both: the first one answered)
            fut.set_result(True)


def _fail(fut: Future | None, why: str) -> None:
    if fut is not None:
        with contextlib.suppress(InvalidStateError):
            fut.set_exception(NotDurable(why))


class _Answers:
    """The answers to one replayed batch (a record's answer may come after the client's ``flush`` returned)."""

    def __init__(self, n: int) -> None:
        self.lock = threading.Lock()
        self.answered = self.acknowledged = 0
        self.n = n
        self.all_answered = threading.Event()

    def done(self, exc: BaseException | None) -> None:
        with self.lock:
            self.answered += 1
            self.acknowledged += exc is None
            if self.answered == self.n:
                self.all_answered.set()

    def all_acknowledged(self, timeout_s: float) -> bool:
        self.all_answered.wait(timeout_s)
        with self.lock:
            return self.acknowledged == self.n


def _close(producer: RecordProducer | None, force: bool = True) -> None:
    """Drop a producer, on a thread of its own (a close waits for the client's threads). Forced, its pending
    records are dropped: they are in the spool (``RecordProducer.close``)."""
    if producer is None:
        return

    def close() -> None:
        try:
            producer.close(force)
        except Exception as exc:
            log.debug("producer close: %s", exc)

    threading.Thread(target=close, name="streamrl-producer-close", daemon=True).start()
