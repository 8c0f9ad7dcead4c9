"""The spool with the real broker: an outage, records given meanwhile, the broker back (and Kafka unreachable
with the spool at its bound)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from support.kafka_reader import LogReader, wait_until
from support.services import LOG_DIR

from streamrl.broker.embedded import EmbeddedBroker, free_port
from streamrl.broker.topics import Topics
from streamrl.gateway.recording.delivery import (
    DELIVERED,
    NCOUNTS,
    REPLAYED,
    SPOOL_DROPPED,
    SPOOL_FULL,
    SPOOL_RECORDS,
    SPOOLED,
    SPOOLING,
    NotDurable,
)
from streamrl.gateway.recording.kafka_producers import PRODUCER_CLIENTS
from streamrl.gateway.recording.log_producer import LogProducer, SenderConfig


def per_key(records: list[tuple[str, int, bytes | None, bytes]]) -> dict[bytes | None, list[bytes]]:
    out: dict[bytes | None, list[bytes]] = {}
    for _, _, key, value in records:
        out.setdefault(key, []).append(value)
    return out


@pytest.mark.parametrize("client", PRODUCER_CLIENTS)
def test_records_given_during_a_broker_outage_arrive_in_order_once_it_is_back(tmp_path: Path, client: str) -> None:
    """A producer process with a spool: Kafka stops (the process is gone), records keep coming and are
    spooled, rewards given as durable are answered once fsynced there; the broker comes back on the
    same port (an empty log: the embedded broker keeps none) and every record arrives, each key's in
    the order given, none twice (nothing was in flight when the broker stopped)."""
    topics = Topics("spool")
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    broker = EmbeddedBroker(topics=topics, partitions=2, log_file=LOG_DIR / "broker-spool.log").start()
    producer = LogProducer(broker.bootstrap_servers, process=True, spool_dir=tmp_path, spool_after_ms=300,
                           send_timeout_ms=3_000, client=client)
    try:
        before = [(f"k{i % 4}".encode(), f"before-{i}".encode()) for i in range(20)]
        for key, value in before:
            assert producer.offer(topics.completions, key, value)
        wait_until(lambda: producer.stats.delivered == 20, "records delivered before the outage")
        broker.stop()
        during = [(f"k{i % 4}".encode(), f"during-{i}".encode()) for i in range(200)]
        for key, value in during:
            assert producer.offer(topics.completions, key, value)
        wait_until(lambda: producer.stats.spool_records == 200, "records spooled")
        assert producer.stats.delivered == 20 and producer.stats.undelivered == 0
        broker.start()
        reader = LogReader(broker.bootstrap_servers, [topics.completions])
        got = reader.read_until(200)
        reader.close()
        wait_until(lambda: not producer.stats.spooling, "spool drained, records go straight to Kafka")
        after = [(f"k{i % 4}".encode(), f"after-{i}".encode()) for i in range(20)]
        for key, value in after:  # straight to Kafka again, behind the replayed ones
            assert producer.offer(topics.completions, key, value)
        reader = LogReader(broker.bootstrap_servers, [topics.completions])
        got = reader.read_until(220)
        reader.close()
    finally:
        producer.close()
        broker.stop()
    expected: dict[bytes | None, list[bytes]] = {}
    for key, value in during + after:
        expected.setdefault(key, []).append(value)
    assert per_key(got) == expected
    stats = producer.stats
    assert (stats.offered, stats.delivered, stats.undelivered) == (240, 240, 0)
    # the outage's 200 went through the spool (and the first records too if given before the producer
    # process had connected: until then it spools)
    assert stats.spooled == stats.replayed and stats.spooled in (200, 220)


@pytest.mark.parametrize("client", PRODUCER_CLIENTS)
def test_durable_records_are_answered_from_the_spool_while_kafka_is_down(tmp_path: Path, client: str,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """``put_many(durable=True)``: with the broker down, futures resolve once the records are fsynced in
    the spool; a new process on the same spool delivers them when the broker is up, and says so: what it found
    left, then the drain. A start on an empty spool with Kafka up says nothing above INFO."""
    caplog.set_level(logging.INFO, "streamrl.gateway.recording.delivery")
    topics = Topics("spool-durable")
    broker = EmbeddedBroker(topics=topics, partitions=2, log_file=LOG_DIR / "broker-spool.log")
    config = SenderConfig(broker.bootstrap_servers, None, 2_000, "test", str(tmp_path), spool_after_ms=300,
                          client=client)
    counts = [0] * NCOUNTS
    delivery = config.delivery(counts, "rewards", linger_ms=0)  # no broker yet: it starts spooling
    futures = delivery.put_many([(topics.rewards, f"t{i}".encode(), f"r{i}".encode()) for i in range(30)],
                                durable=True)
    assert all(f.result(timeout=30) for f in futures)
    assert counts[SPOOLED] == 30 and counts[SPOOL_RECORDS] == 30
    delivery.close(1.0)
    broker.start()
    try:
        counts2 = [0] * NCOUNTS
        again = config.delivery(counts2, "rewards", linger_ms=0)
        reader = LogReader(broker.bootstrap_servers, [topics.rewards])
        got = reader.read_until(30)
        reader.close()
        wait_until(lambda: counts2[SPOOL_RECORDS] == 0 and not counts2[SPOOLING], "spool drained")
        again.close(5.0)
        found = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert any("holds 30 records an earlier run did not deliver" in m for m in found), found
        assert any("drained: records go straight to Kafka again" in m for m in found), found
        caplog.clear()
        counts3 = [0] * NCOUNTS
        fresh = SenderConfig(broker.bootstrap_servers, None, 2_000, "test", str(tmp_path / "fresh"),
                             spool_after_ms=300, client=client).delivery(counts3, "rewards", linger_ms=0)
        fresh.put(topics.rewards, b"t", b"r")
        wait_until(lambda: counts3[DELIVERED] == 1 and not counts3[SPOOLING], "record delivered")
        fresh.close(5.0)
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    finally:
        broker.stop()
    assert sorted(v for *_, v in got) == sorted(f"r{i}".encode() for i in range(30))
    assert counts2[REPLAYED] == 30


def test_a_full_spool_drops_records_counts_them_and_refuses_durability(tmp_path: Path) -> None:
    """Kafka unreachable and the spool at its bound: records are dropped and counted, the spool says it
    is full, and a caller waiting for durability is told it did not get it (the gateway answers 503)."""
    config = SenderConfig(f"127.0.0.1:{free_port()}", None, 1_000, "test", str(tmp_path), spool_max_bytes=4_000)
    counts = [0] * NCOUNTS
    delivery = config.delivery(counts, "rewards", linger_ms=0)  # nothing listens there: it spools
    try:
        kept = delivery.put_many([("t", b"k", b"x" * 1_000)] * 3, durable=True)
        assert all(f.result(timeout=30) for f in kept)
        refused = delivery.put_many([("t", b"k", b"y" * 1_000)] * 2, durable=True)
        for f in refused:
            with pytest.raises(NotDurable, match="spool full"):
                f.result(timeout=30)
        delivery.put("t", b"k", b"z" * 1_000)  # fire and forget: dropped, counted
        assert (counts[SPOOLED], counts[SPOOL_DROPPED], counts[SPOOL_FULL], counts[SPOOL_RECORDS]) == (3, 3, 1, 3)
    finally:
        delivery.close(1.0)
