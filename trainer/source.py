"""Raw record consumption from Kafka: explicit partition assignment, exact offsets, commits.

The trainer owns its offsets (they are checkpointed with the adapter), so it ``assign()``s every
partition of the completions and rewards topics and ``seek()``s to the checkpointed offsets: no
consumer-group join, hence no rebalance wait. Offsets are still committed to Kafka under a group id
after each checkpoint, so lag is visible to the usual tools; on a fresh start without a checkpoint the
committed offsets are where reading resumes, else the beginning of the log.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass

from streamrl.broker.clients import POLL_ALL
from streamrl.broker.security import KafkaSecurity
from streamrl.broker.topics import Topics

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RawRecord:
    stream: str
    """"c" (completions topic) or "r" (rewards topic)."""
    value: bytes | None
    position: str
    """"<topic>:<partition>" of the record."""
    offset: int


class RecordSource(ABC):
    """Where raw completion and reward records come from."""

    @abstractmethod
    def poll(self, timeout_s: float) -> list[RawRecord]: ...

    @abstractmethod
    def offsets(self) -> dict[str, int]:
        """Next offset to read per ``"<topic>:<partition>"`` (everything before it has been returned)."""

    def set_paused(self, paused: bool) -> None:  # noqa: B027 - optional for backends
        """Stop (``True``) or restart (``False``) fetching: backpressure from a full ready queue.

        While paused, ``poll`` returns nothing new; records it already returned stay returned and
        ``offsets()`` does not move, so pausing never skips or repeats a record. A backend that cannot
        pause may ignore this: the feed does not poll while its queue is full.
        """

    def skip_before(self, timestamp_ms: int) -> int:
        """Move every partition's position forward past the records written before ``timestamp_ms``,
        without reading them; returns how many records were skipped. Never moves backwards. A backend
        that cannot look up offsets by time skips nothing (0)."""
        return 0

    def commit(self, offsets: dict[str, int]) -> None:  # noqa: B027 - optional for backends
        """Record progress where monitoring can see it (Kafka group offsets)."""

    def lag(self) -> int | None:
        """Records written but not yet read, over every partition, as last known (None: unknown)."""
        return None

    def close(self) -> None:  # noqa: B027
        pass


class KafkaRecordSource(RecordSource):
    def __init__(self, bootstrap_servers: str, topics: Topics, group_id: str,
                 start: dict[str, int] | None = None, *, partition_timeout_s: float = 30.0,
                 security: KafkaSecurity | None = None) -> None:
        from kafka import TopicPartition

        from streamrl.broker.clients import PLAINTEXT, make_consumer

        self._stream = {topics.completions: "c", topics.rewards: "r"}
        self.consumer = make_consumer(bootstrap_servers, group_id=group_id, security=security or PLAINTEXT,
                                      client_id="streamrl-trainer")
        tps = []
        for topic in self._stream:
            parts = self._partitions(topic, partition_timeout_s)
            tps += [TopicPartition(topic, p) for p in sorted(parts)]
        self.consumer.assign(tps)
        self._next: dict[str, int] = {}
        for tp in tps:
            key = f"{tp.topic}:{tp.partition}"
            offset = (start or {}).get(key)
            if offset is None:
                committed = self._committed(tp)
                offset = committed if committed is not None else None
            if offset is None:
                self.consumer.seek_to_beginning(tp)
                offset = self.consumer.position(tp)
            else:
                self.consumer.seek(tp, offset)
            self._next[key] = offset
        log.info("consuming %s from %s", ", ".join(self._stream), self._next)

    def _partitions(self, topic: str, timeout_s: float) -> set[int]:
        import time

        deadline = time.monotonic() + timeout_s
        while True:
            parts = self.consumer.partitions_for_topic(topic)
            if parts:
                return parts
            if time.monotonic() > deadline:
                raise TimeoutError(f"topic {topic} has no partitions (does it exist?)")
            time.sleep(0.2)

    def _committed(self, tp) -> int | None:
        try:
            return self.consumer.committed(tp, timeout_ms=5_000)
        except Exception as exc:  # broker without group coordination: start from the beginning
            log.warning("cannot read committed offset of %s: %s", tp, exc)
            return None

    def poll(self, timeout_s: float) -> list[RawRecord]:
        out = []
        for tp, records in self.consumer.poll(timeout_ms=int(timeout_s * 1000), max_records=POLL_ALL).items():
            key = f"{tp.topic}:{tp.partition}"
            stream = self._stream[tp.topic]
            for r in records:
                out.append(RawRecord(stream, r.value, key, r.offset))
                self._next[key] = r.offset + 1
        return out

    def offsets(self) -> dict[str, int]:
        return dict(self._next)

    def skip_before(self, timestamp_ms: int) -> int:
        """Kafka's offsets-for-times lookup (ListOffsets by timestamp), then ``seek``. A partition with no
        record at or after the time (the lookup says None, or the embedded broker a timestamp of -1) is
        left where it is: its end offset cannot be trusted on every broker, so those records are read
        and judged instead. A fetch already buffered for a partition is discarded by the client on the
        seek, so no record before the new position is returned."""
        assignment = list(self.consumer.assignment())
        found = self.consumer.offsets_for_times({tp: timestamp_ms for tp in assignment})
        skipped = 0
        for tp in assignment:
            at = found.get(tp)
            key = f"{tp.topic}:{tp.partition}"
            if at is None or at.timestamp < 0 or at.offset <= self._next[key]:
                continue
            skipped += at.offset - self._next[key]
            self.consumer.seek(tp, at.offset)
            self._next[key] = at.offset
        return skipped

    def lag(self) -> int | None:
        """From the high watermarks of the last fetch responses (no request to the broker)."""
        total, known = 0, False
        for tp in self.consumer.assignment():
            high = self.consumer.highwater(tp)
            if high is not None:
                total += max(0, high - self._next.get(f"{tp.topic}:{tp.partition}", 0))
                known = True
        return total if known else None

    def set_paused(self, paused: bool) -> None:
        """kafka-python's ``pause``/``resume`` of every assigned partition. A fetch already buffered or
        in flight for a paused partition is parked or discarded by the client, never returned, and the
        consumer's position moves only when ``poll`` returns records; after ``resume`` fetching goes on
        from that position, which is ``self._next``."""
        if paused:
            self.consumer.pause(*self.consumer.assignment())
        else:
            self.consumer.resume(*self.consumer.paused())

    def commit(self, offsets: dict[str, int]) -> None:
        from kafka import TopicPartition
        from kafka.structs import OffsetAndMetadata

        try:
            self.consumer.commit({TopicPartition(k.rsplit(":", 1)[0], int(k.rsplit(":", 1)[1])):
                                  OffsetAndMetadata(v, "", -1) for k, v in offsets.items()}, timeout_ms=5_000)
        except Exception as exc:  # monitoring only: the checkpoint is the source of truth
            log.warning("offset commit failed: %s", exc)

    def close(self) -> None:
        self.consumer.close(autocommit=False)
