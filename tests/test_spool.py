"""The spool's file format and bookkeeping: order, restart, torn tail, corrupt frames, bounds, cleanup."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import LOG_DIR
from kafka import TopicPartition

from streamrl.broker.clients import make_consumer
from streamrl.broker.delivery import (
    NCOUNTS,
    REPLAYED,
    SPOOL_DROPPED,
    SPOOL_FULL,
    SPOOL_RECORDS,
    SPOOLED,
    NotDurable,
)
from streamrl.broker.embedded import EmbeddedBroker, free_port
from streamrl.broker.kafka_producers import PRODUCER_CLIENTS
from streamrl.broker.log_producer import LogProducer, SenderConfig
from streamrl.broker.spool import HEAD, SUFFIX, Spool, SpoolFull, SpoolRecord, encode_frame
from streamrl.broker.topics import Topics


def _records(n: int, tag: str = "r", size: int = 100, keyless: bool = True) -> list[SpoolRecord]:
    """Records of one size, but every fifth without a key (``keyless``), which makes it shorter."""
    return [SpoolRecord(f"topic-{i % 3}", None if keyless and i % 5 == 0 else f"{tag}-{i:04d}".encode(),
                        f"{tag}-{i:04d}|".encode() + bytes([i % 256]) * size, 1_700_000_000_000 + i)
            for i in range(n)]


def _start(recs: list[SpoolRecord], i: int) -> int:
    """Where the ``i``-th record's frame starts in a segment holding ``recs``."""
    return sum(len(encode_frame(r)) for r in recs[:i])


def _drain(spool: Spool, batch: int = 7) -> list[SpoolRecord]:
    """Read everything in batches, committing each."""
    out: list[SpoolRecord] = []
    while True:
        got, pos = spool.read(max_records=batch)
        if not got:
            return out
        out += got
        spool.commit(pos, len(got))


def _segments(d: Path) -> list[Path]:
    return sorted(d.glob(f"*{SUFFIX}"))


def test_replays_in_order_across_segments_and_deletes_delivered_segments(tmp_path: Path) -> None:
    spool = Spool(tmp_path, segment_bytes=2_000)
    recs = _records(100)
    for i in range(0, 100, 10):
        spool.append(recs[i:i + 10])
    assert spool.records == 100 and len(_segments(tmp_path)) > 3
    assert _drain(spool) == recs
    assert spool.empty and spool.records == 0
    assert len(_segments(tmp_path)) <= 2 and spool.bytes <= 2_000 + 2 * len(encode_frame(recs[0]))
    spool.append(recs[:3])  # appends after a full drain are read too
    assert _drain(spool) == recs[:3]
    spool.close()


def test_restart_replays_from_the_persisted_cursor(tmp_path: Path) -> None:
    recs = _records(50)
    spool = Spool(tmp_path, segment_bytes=1_500)
    spool.append(recs[:30])
    got, pos = spool.read(max_records=12)
    spool.commit(pos, len(got))
    got2, _ = spool.read(max_records=5)  # read, not committed: delivered again after a restart
    assert got + got2 == recs[:17]
    spool.append(recs[30:])
    spool.close()  # (a kill -9 leaves the same files: appends are single writes, the cursor a rename)
    again = Spool(tmp_path, segment_bytes=1_500)
    assert again.records == 38 and again.corrupt == 0
    assert _drain(again) == recs[12:]
    again.close()


def test_one_process_per_spool_directory(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    with pytest.raises(RuntimeError, match="in use"):
        Spool(tmp_path)
    spool.close()
    Spool(tmp_path).close()


def test_torn_tail_is_cut_and_appends_continue(tmp_path: Path) -> None:
    recs = _records(10)
    spool = Spool(tmp_path)
    spool.append(recs[:9])
    spool.close()
    seg = _segments(tmp_path)[-1]
    whole = seg.stat().st_size
    with open(seg, "ab") as f:  # a crash in the middle of writing the 10th frame
        f.write(encode_frame(recs[9])[:HEAD.size + 20])
    again = Spool(tmp_path)
    assert again.torn_bytes == HEAD.size + 20 and seg.stat().st_size == whole
    assert again.records == 9 and again.corrupt == 0
    again.append(recs[9:])
    assert _drain(again) == recs
    again.close()


def test_bad_checksum_is_counted_and_skipped(tmp_path: Path) -> None:
    recs = _records(10)
    spool = Spool(tmp_path)
    spool.append(recs)
    spool.close()
    seg = _segments(tmp_path)[-1]
    data = bytearray(seg.read_bytes())
    data[_start(recs, 4) + HEAD.size + 30] ^= 0xFF  # a flipped bit in the value of the 5th record
    seg.write_bytes(bytes(data))
    again = Spool(tmp_path)
    assert again.corrupt == 1 and again.records == 9 and again.torn_bytes == 0
    assert _drain(again) == recs[:4] + recs[5:]
    again.close()


def test_corrupt_length_resynchronises_on_the_next_frame(tmp_path: Path) -> None:
    recs = _records(6)
    spool = Spool(tmp_path)
    spool.append(recs)
    spool.close()
    seg = _segments(tmp_path)[-1]
    data = bytearray(seg.read_bytes())
    data[_start(recs, 2) + 2:_start(recs, 2) + 6] = (10 << 20).to_bytes(4, "little")  # 3rd frame claims 10 MB
    seg.write_bytes(bytes(data))
    again = Spool(tmp_path)
    assert again.corrupt == 1 and again.records == 5
    assert _drain(again) == recs[:2] + recs[3:]
    again.close()


def test_bound_in_bytes_refuses_whole_appends_and_room_comes_back(tmp_path: Path) -> None:
    recs = _records(12, keyless=False)
    frame = len(encode_frame(recs[0]))
    spool = Spool(tmp_path, max_bytes=10 * frame, segment_bytes=3 * frame)
    for r in recs[:8]:  # one append goes into one segment: one at a time, so that segments hold 3 each
        spool.append([r])
    with pytest.raises(SpoolFull):
        spool.append(recs[8:11])  # 3 more would pass the bound: none is appended
    assert spool.full and spool.records == 8 and spool.bytes == 8 * frame
    spool.append(recs[8:9])
    spool.append(recs[9:10])
    assert spool.records == 10 and spool.bytes == 10 * frame
    with pytest.raises(SpoolFull):
        spool.append(recs[10:11])
    got, pos = spool.read(max_records=6)  # delivering frees whole segments
    spool.commit(pos, len(got))
    assert spool.bytes == 4 * frame  # the two segments of records 0-5 are gone
    spool.append(recs[10:12])
    assert not spool.full
    assert got + _drain(spool) == recs
    spool.close()


def test_fsynced_append_and_read_bounds(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    big = SpoolRecord("t", b"k", b"x" * 100_000, 1)
    spool.append([big] * 5, sync=True)
    got, _ = spool.read(max_records=100, max_bytes=250_000)
    assert len(got) in (2, 3) and got[0] == big
    got2, _ = spool.read(max_records=100, max_bytes=1)  # at least one record however small the bound
    assert len(got2) == 1
    spool.close()


# -- with the real broker: an outage, records given meanwhile, the broker back -----------------------------


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
def test_durable_records_are_answered_from_the_spool_while_kafka_is_down(tmp_path: Path, client: str) -> None:
    """``put_many(durable=True)``: with the broker down, futures resolve once the records are fsynced in
    the spool; a new process on the same spool delivers them when the broker is up."""
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
        wait_until(lambda: counts2[SPOOL_RECORDS] == 0, "spool drained")
        again.close(5.0)
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
