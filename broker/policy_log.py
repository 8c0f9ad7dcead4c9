"""The policy topic as a log of versions: publish one, or ask which is the newest.

Written by the trainer after each step and by ``streamrl publish`` (a rollback, an adapter trained
elsewhere, the hot-swap tests); followed by the gateways (``gateway/hotswap.py`` tails it). A record is
keyed by the policy name, so one name's versions stay in one partition, in order.
"""

from __future__ import annotations

import time
from pathlib import Path

from kafka import TopicPartition

from .clients import PLAINTEXT, make_consumer, make_producer
from .schema import WEIGHTS_FILE, PolicyRecord, RecordError, decode, encode, sha256_file
from .security import KafkaSecurity
from .topics import Topics


class PolicyLog:
    """A producer on the policy topic (``acks=all``, no linger: a version is one record, sent at once)."""

    def __init__(self, bootstrap_servers: str, topics: Topics, client_id: str = "streamrl", *,
                 security: KafkaSecurity = PLAINTEXT, publisher: str | None = None) -> None:
        self.bootstrap_servers, self.security = bootstrap_servers, security
        self.publisher = publisher
        """Stamped on every record published here (a gateway may serve only trusted publishers' versions)."""
        self.topic = topics.policy
        self.producer = make_producer(bootstrap_servers, security=security, client_id=client_id, acks="all",
                                      linger_ms=0)

    def publish(self, record: PolicyRecord) -> PolicyRecord:
        """Send ``record``, stamped now (publish -> served is measured from here), and wait for the ack."""
        record.created = time.time()
        if self.publisher is not None:
            record.publisher = self.publisher
        self.producer.send(self.topic, key=record.name.encode(), value=encode(record)).get(timeout=30)
        return record

    def newest(self, name: str, timeout_s: float = 5.0) -> PolicyRecord | None:
        """The record of the highest version of ``name`` on the topic (None when none), read from the beginning
        to the end."""
        consumer = make_consumer(self.bootstrap_servers, group_id=None, security=self.security,
                                 client_id="streamrl-policy-log")
        try:
            tps = [TopicPartition(self.topic, p) for p in consumer.partitions_for_topic(self.topic) or {0}]
            consumer.assign(tps)
            consumer.seek_to_beginning(*tps)
            end = consumer.end_offsets(tps)
            best: PolicyRecord | None = None
            deadline = time.monotonic() + timeout_s
            # to the end offsets, then until a poll comes back empty: some brokers (tansu) under-report
            # the end of a multi-record batch
            while time.monotonic() < deadline:
                polled = consumer.poll(timeout_ms=300)
                for records in polled.values():
                    for r in records:
                        try:
                            rec = decode(r.value)
                        except RecordError:
                            continue
                        if isinstance(rec, PolicyRecord) and rec.name == name and (
                                best is None or rec.version > best.version):
                            best = rec
                if not polled and all(consumer.position(tp) >= end[tp] for tp in tps):
                    break
            return best
        finally:
            consumer.close()

    def last_version(self, name: str, timeout_s: float = 5.0) -> int:
        """The highest version of ``name`` on the topic, 0 when none (``newest``'s version)."""
        record = self.newest(name, timeout_s)
        return record.version if record is not None else 0

    def close(self) -> None:
        self.producer.flush(timeout=10)
        self.producer.close(timeout=5)


def adapter_record(name: str, version: int, path: Path, base_model: str, *, step: int = 0,
                   metrics: dict[str, float] | None = None) -> PolicyRecord:
    """The policy record of an adapter directory, with the sha256 of its weights file computed here."""
    return PolicyRecord(name=name, version=version, path=str(Path(path).resolve()), base_model=base_model,
                        step=step, sha256=sha256_file(Path(path) / WEIGHTS_FILE), metrics=metrics or {})


def publish_version(bootstrap_servers: str, topics: Topics, name: str, version: int | None, path: Path,
                    base_model: str, *, step: int = 0, metrics: dict[str, float] | None = None,
                    security: KafkaSecurity = PLAINTEXT, publisher: str | None = None,
                    client_id: str = "streamrl") -> PolicyRecord:
    """Publish one adapter directory as ``name`` version ``version`` (None: one past the newest on the topic)
    and wait for the ack (one-off: a caller publishing often keeps a ``PolicyLog``)."""
    log = PolicyLog(bootstrap_servers, topics, client_id, security=security, publisher=publisher)
    try:
        if version is None:
            version = log.last_version(name) + 1
        return log.publish(adapter_record(name, version, path, base_model, step=step, metrics=metrics))
    finally:
        log.close()
