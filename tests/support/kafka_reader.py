"""Test-side Kafka helpers shared by the tests: a topic reader, a reader of whole topics of a restarted
broker, and producing records as the gateway does."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kafka import TopicPartition

from streamrl.broker.clients import make_consumer, make_producer
from streamrl.broker.schema import CompletionRecord, decode, encode
from streamrl.broker.topics import Topics


class TopicReader:
    """Reads a topic from (about) its end at creation time; ``wait_for`` polls until a matching record
    arrives. The embedded broker reports the base offset of the last batch as the end, so a few older
    records may be read again: match on ids unique to the test, never on "the next record"."""

    def __init__(self, bootstrap_servers: str, topic: str) -> None:
        self.consumer = make_consumer(bootstrap_servers, group_id=None)
        parts = self.consumer.partitions_for_topic(topic) or set()
        deadline = time.monotonic() + 10
        while not parts and time.monotonic() < deadline:
            parts = self.consumer.partitions_for_topic(topic) or set()
        tps = [TopicPartition(topic, p) for p in sorted(parts)]
        self.consumer.assign(tps)
        self.consumer.seek_to_end(*tps)
        for tp in tps:
            self.consumer.position(tp)  # resolve "end" now, before the records under test are produced
        self.seen: list[Any] = []

    def wait_for(self, match: Callable[[Any], bool], count: int = 1, timeout: float = 30.0,
                 explain: Callable[[], object] | None = None) -> list[Any]:
        """``explain``: called on a timeout, its answer (e.g. the gateway's producer counts) goes into the error."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [r for r in self.seen if match(r)]
            if len(found) >= count:
                return found
            for batch in self.consumer.poll(timeout_ms=200).values():
                for message in batch:
                    self.seen.append(decode(message.value))
        found = sum(1 for r in self.seen if match(r))
        extra = f"; {explain()}" if explain is not None else ""
        raise AssertionError(f"{count} matching record(s) not seen within {timeout}s: {found} of {len(self.seen)} "
                             f"read matched{extra}")

    def close(self) -> None:
        self.consumer.close()


def produce(bootstrap: str, topics: Topics, records: list, raw: list[tuple[str, bytes]] = (),
            timestamp_ms: int | None = None) -> None:
    """As the gateway does: the shared schema's encoding, keyed by trajectory id (``raw``: undecodable
    values sent as they are); acked before returning. ``timestamp_ms``: the records' Kafka timestamp
    (default: now), to produce records as if long ago; a ``(record, timestamp_ms)`` item gives its own."""
    p = make_producer(bootstrap)
    for item in records:
        r, ts = item if isinstance(item, tuple) else (item, timestamp_ms)
        topic = topics.completions if isinstance(r, CompletionRecord) else topics.rewards
        p.send(topic, key=r.trajectory_id.encode(), value=encode(r), timestamp_ms=ts)
    for topic, value in raw:
        p.send(topic, key=b"bad", value=value)
    p.flush()
    p.close()


class LogReader:
    """Every record of some topics of a (restarted, so empty at first) broker, from the beginning."""

    def __init__(self, bootstrap_servers: str, topics: list[str]) -> None:
        self.consumer = make_consumer(bootstrap_servers, group_id=None)
        parts = []
        for topic in topics:
            wait_until(lambda t=topic: self.consumer.partitions_for_topic(t), f"partitions of {topic}")
            parts += [TopicPartition(topic, p) for p in sorted(self.consumer.partitions_for_topic(topic))]
        self.consumer.assign(parts)
        self.consumer.seek_to_beginning(*parts)
        self.records: list[tuple[str, int, bytes | None, bytes]] = []
        """(topic, partition, key, value) in log order per partition."""

    def read_until(self, count: int, timeout_s: float = 60.0) -> list[tuple[str, int, bytes | None, bytes]]:
        deadline = time.monotonic() + timeout_s
        while len(self.records) < count and time.monotonic() < deadline:
            for tp, batch in self.consumer.poll(timeout_ms=200).items():
                self.records += [(tp.topic, tp.partition, m.key, m.value) for m in batch]
        assert len(self.records) >= count, f"{len(self.records)} of {count} records arrived"
        return self.records

    def close(self) -> None:
        self.consumer.close()


def wait_until(check: Callable[[], object], what: str, timeout_s: float = 60.0) -> object:
    """Poll ``check`` (state in another process or thread, with no event to wait on) until it holds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout_s}s: {what}")
