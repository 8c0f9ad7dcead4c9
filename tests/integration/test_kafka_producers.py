"""The record producer's Kafka clients (``gateway/recording/kafka_producers.py``), both of them, against the embedded broker:
what ``Delivery`` relies on (every record answered once, a key's records in order on murmur2's partition, an
unreachable broker found out at connect, a forced close that drops what is pending and answers it)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import pytest
from kafka import TopicPartition
from kafka.partitioner import murmur2
from support.services import LOG_DIR

from streamrl.broker.clients import make_consumer
from streamrl.broker.embedded import EmbeddedBroker, free_port
from streamrl.broker.security import KafkaSecurity
from streamrl.broker.topics import Topics, create_topics
from streamrl.gateway.recording.kafka_producers import (
    PRODUCER_CLIENTS,
    KafkaUnreachable,
    RecordProducer,
    connect,
)

PARTITIONS = 8


class Answers:
    """Each record's answers, by its index."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.got: dict[int, list[BaseException | None]] = {}
        self.all_in = threading.Event()
        self.expected = 0

    def done_for(self, i: int) -> Callable[[BaseException | None], None]:
        self.expected += 1

        def done(exc: BaseException | None) -> None:
            with self.lock:
                self.got.setdefault(i, []).append(exc)
                if len(self.got) == self.expected:
                    self.all_in.set()
        return done


def producer(client: str, bootstrap: str, send_timeout_ms: int = 10_000) -> RecordProducer:
    return connect(client, bootstrap, security=KafkaSecurity(), compression="zstd", linger_ms=5,
                   send_timeout_ms=send_timeout_ms, client_id=f"test-{client}")


@pytest.mark.parametrize("client", PRODUCER_CLIENTS)
def test_records_are_acknowledged_once_in_order_on_their_keys_murmur2_partition(broker: EmbeddedBroker,
                                                                                  client: str) -> None:
    """40 keys x 5 records: each answered once with success; read back, each key's records are in the order
    sent, with the timestamps given, all on partition murmur2(key) % n (the Java client's, and kafka-python's,
    so that completions and rewards of a trajectory land on partitions of the same number whichever client
    wrote them)."""
    topics = Topics(f"kp-{client}")
    create_topics(broker.bootstrap_servers, topics, partitions=PARTITIONS)
    p = producer(client, broker.bootstrap_servers)
    answers, sent = Answers(), []
    try:
        for n in range(5):
            for k in range(40):
                key, value = f"trajectory-{k}".encode(), f"{k}:{n}".encode() * 50
                p.send(topics.completions, key, value, 1_700_000_000_000 + n, answers.done_for(len(sent)))
                sent.append((key, value))
        p.flush(30)
        assert answers.all_in.wait(10), f"{len(answers.got)} of {len(sent)} records answered"
    finally:
        p.close(force=False)
    assert all(a == [None] for a in answers.got.values())
    consumer = make_consumer(broker.bootstrap_servers, group_id=None)
    parts = [TopicPartition(topics.completions, i) for i in range(PARTITIONS)]
    consumer.assign(parts)
    consumer.seek_to_beginning(*parts)
    got: dict[bytes, list[tuple[int, bytes, int]]] = {}
    deadline = time.monotonic() + 30
    while sum(map(len, got.values())) < len(sent) and time.monotonic() < deadline:
        for tp, batch in consumer.poll(timeout_ms=200).items():
            for m in batch:
                got.setdefault(m.key, []).append((tp.partition, m.value, m.timestamp))
    consumer.close()
    for key in {k for k, _ in sent}:
        assert [v for _, v, _ in got[key]] == [v for k, v in sent if k == key]
        assert {part for part, _, _ in got[key]} == {(murmur2(key) & 0x7FFFFFFF) % PARTITIONS}
        assert [ts for *_, ts in got[key]] == [1_700_000_000_000 + n for n in range(5)]


@pytest.mark.parametrize("client", PRODUCER_CLIENTS)
def test_an_unreachable_broker_fails_the_connect_within_seconds(client: str) -> None:
    started = time.monotonic()
    with pytest.raises(KafkaUnreachable, match="no Kafka broker answered"):
        producer(client, f"127.0.0.1:{free_port()}")
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("client", PRODUCER_CLIENTS)
def test_a_forced_close_drops_pending_records_and_answers_them(client: str) -> None:
    """The broker stops with records pending: a forced close returns within seconds (it does not wait out the
    send timeout) and every record sent is answered once, with an error; none reaches the broker when it is
    back (they are in the spool by then: a late one could overtake the spool's replay)."""
    topics = Topics(f"kp-close-{client}")
    broker = EmbeddedBroker(topics=topics, partitions=2, log_file=LOG_DIR / "broker-kp-close.log").start()
    try:
        p = producer(client, broker.bootstrap_servers, send_timeout_ms=60_000)
        broker.stop()
        answers = Answers()
        for i in range(20):
            p.send(topics.completions, f"k{i}".encode(), b"x" * 100, int(time.time() * 1000), answers.done_for(i))
        started = time.monotonic()
        p.close(force=True)
        assert time.monotonic() - started < 10
        assert answers.all_in.wait(10), f"{len(answers.got)} of 20 records answered"
        assert all(len(a) == 1 and isinstance(a[0], Exception) for a in answers.got.values())
        broker.start()
        consumer = make_consumer(broker.bootstrap_servers, group_id=None)
        parts = [TopicPartition(topics.completions, i) for i in range(2)]
        consumer.assign(parts)
        assert sum(consumer.end_offsets(parts).values()) == 0
        consumer.close()
    finally:
        broker.stop()


def test_librdkafka_says_a_lost_broker_once_not_at_every_retry(caplog: pytest.LogCaptureFixture) -> None:
    """The broker goes away under an idle librdkafka client: it retries the connection several times a second,
    each retry a log line; the first is said at its level (an error), the repeats at debug."""
    broker = EmbeddedBroker(topics=Topics("kp-quiet"), partitions=1, log_file=LOG_DIR / "broker-kp-quiet.log").start()
    caplog.set_level(logging.DEBUG, logger="streamrl.librdkafka")
    p = producer("librdkafka", broker.bootstrap_servers)
    try:
        broker.stop()
        deadline = time.monotonic() + 30
        while len(fails := [r for r in caplog.records if r.args and r.args[0] == "FAIL"
                            and "Connection refused" in str(r.args[-1])]) < 4:
            assert time.monotonic() < deadline, f"{len(fails)} retries logged in 30 s"
            time.sleep(0.05)
        assert [r.levelno for r in fails] == [logging.ERROR] + [logging.DEBUG] * (len(fails) - 1)
    finally:
        p.close(force=True)
        broker.stop()
