"""The Kafka client a ``Delivery`` (``delivery.py``) sends records through: a small base and two backends.

``librdkafka`` (confluent-kafka, the default) batches, compresses and sends in C threads that never take the
process's GIL; only its delivery reports come back to Python, served by one thread here. ``kafka-python``
does all of that in Python threads. Measured (``bench/kafka_client_bench.py``, 14 KB records, zstd): 39 us of
the process's CPU per record against 106 us on the H200 host (64 against 162 on 2 cores), on a host whose
cores the gateway's event loop shares with the record-producer process. ``kafka-python`` stays selectable (``GatewayConfig.producer_client``) and is what every
other client of streamrl uses (consumers, the policy log, the tail process).

Both are set up the same way for records that must arrive in order and at least once: acks=all, one
request in flight per connection (a retry cannot reorder a partition), not idempotent (the embedded broker
keeps producer ids in memory only, and nothing relies on it), a send timeout after which a record is reported
failed, and murmur2 partitioning of keys (the Java client's, which kafka-python also uses: a key lands on the
same partition whichever client wrote it).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Literal, get_args

from streamrl.broker.clients import make_producer
from streamrl.broker.security import KafkaSecurity

ProducerClient = Literal["librdkafka", "kafka-python"]
PRODUCER_CLIENTS: tuple[str, ...] = get_args(ProducerClient)

Done = Callable[[BaseException | None], None]
"""Called once per record sent: with None when Kafka acknowledged it, with the error when it will not."""


class KafkaUnreachable(ConnectionError):
    """No broker of the bootstrap list answered when the producer was made."""


class RecordProducer(ABC):
    """A connected Kafka producer, as ``Delivery`` uses one."""

    @abstractmethod
    def send(self, topic: str, key: bytes | None, value: bytes, timestamp_ms: int, done: Done) -> None:
        """Queue one record; ``done`` is called from the client's thread. Raises when the record cannot even
        be queued (the client's buffer full, the producer closed): then ``done`` is never called."""

    @abstractmethod
    def flush(self, timeout_s: float) -> None:
        """Send what is queued now and wait (at most ``timeout_s``) until Kafka answered every record sent. A
        record's ``done`` may still be running on the client's thread when this returns."""

    @abstractmethod
    def close(self, force: bool) -> None:
        """Stop the client (blocks: ``Delivery`` calls it on a thread of its own). ``force`` drops what is not
        acknowledged yet instead of waiting for it (those records are in the spool: a client left to retry
        them could deliver one after the spool's replay of a later record of its key)."""


def connect(client: ProducerClient, bootstrap_servers: str, *, security: KafkaSecurity, compression: str | None,
            linger_ms: int, send_timeout_ms: int, client_id: str) -> RecordProducer:
    """A producer of the given client, connected: raises (``KafkaUnreachable`` or the client's own error) when
    no broker answers within 2 s, so that ``Delivery`` keeps spooling and tries again."""
    backends: dict[str, type[KafkaPythonProducer | LibrdkafkaProducer]] = {
        "librdkafka": LibrdkafkaProducer, "kafka-python": KafkaPythonProducer}
    if client not in backends:
        raise ValueError(f"producer client must be one of {', '.join(PRODUCER_CLIENTS)}, not {client!r}")
    return backends[client](bootstrap_servers, security=security, compression=compression, linger_ms=linger_ms,
                            send_timeout_ms=send_timeout_ms, client_id=client_id)


class KafkaPythonProducer(RecordProducer):
    """kafka-python's ``KafkaProducer``; a broker that is down is found out within 2 s (kafka-python waits 30 s
    by default), one back up within 1 s (``clients.RECONNECT_BACKOFF_MAX_MS``)."""

    def __init__(self, bootstrap_servers: str, *, security: KafkaSecurity, compression: str | None, linger_ms: int,
                 send_timeout_ms: int, client_id: str) -> None:
        from kafka.errors import KafkaConnectionError, KafkaTimeoutError

        t = send_timeout_ms
        try:
            self.producer = make_producer(bootstrap_servers, security=security, compression=compression, acks="all",
                                          max_block_ms=t, request_timeout_ms=t, delivery_timeout_ms=t + 5_000,
                                          client_id=client_id, linger_ms=linger_ms,
                                          max_in_flight_requests_per_connection=1, bootstrap_timeout_ms=2_000,
                                          enable_idempotence=False)
        except (KafkaConnectionError, KafkaTimeoutError) as exc:
            raise KafkaUnreachable(f"no Kafka broker answered at {bootstrap_servers}: {exc}") from exc

    def send(self, topic: str, key: bytes | None, value: bytes, timestamp_ms: int, done: Done) -> None:
        future = self.producer.send(topic, key=key, value=value, timestamp_ms=timestamp_ms)
        future.add_callback(_acknowledged, done).add_errback(done)

    def flush(self, timeout_s: float) -> None:
        self.producer.flush(timeout=timeout_s)

    def close(self, force: bool) -> None:
        if force:  # kafka-python's close flushes before it would force: abort its batches first (3.0.12)
            self.producer._sender.force_close()
        self.producer.close(timeout=30)


def _acknowledged(done: Done, _metadata: object) -> None:
    done(None)


class LibrdkafkaProducer(RecordProducer):
    """confluent-kafka's ``Producer``, with a thread that serves its delivery reports (``poll``)."""

    def __init__(self, bootstrap_servers: str, *, security: KafkaSecurity, compression: str | None, linger_ms: int,
                 send_timeout_ms: int, client_id: str) -> None:
        from confluent_kafka import KafkaException, Producer

        t = send_timeout_ms
        config: dict[str, Any] = {
            "bootstrap.servers": bootstrap_servers, "client.id": client_id, "acks": "all",
            "enable.idempotence": False, "max.in.flight.requests.per.connection": 1,
            "compression.type": compression or "none", "linger.ms": linger_ms,
            "batch.size": 1 << 20, "message.max.bytes": 16 << 20, "queue.buffering.max.kbytes": 256 << 10,
            "request.timeout.ms": t, "message.timeout.ms": t + 5_000, "reconnect.backoff.max.ms": 1_000,
            "partitioner": "murmur2_random", "logger": _QuietRepeats(logging.getLogger("streamrl.librdkafka")),
            **security.librdkafka_config(),
        }
        self.producer = Producer(config)
        try:  # librdkafka connects lazily and never fails to construct: ask a broker for metadata
            self.producer.list_topics(timeout=2)
        except KafkaException as exc:
            self.producer.purge()
            raise KafkaUnreachable(f"no Kafka broker answered at {bootstrap_servers}: {exc}") from exc
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve_reports, name="streamrl-librdkafka-reports", daemon=True)
        self.thread.start()

    def _serve_reports(self) -> None:
        while not self.stopping.is_set():
            self.producer.poll(0.1)

    def send(self, topic: str, key: bytes | None, value: bytes, timestamp_ms: int, done: Done) -> None:
        self.producer.produce(topic, value=value, key=key, timestamp=timestamp_ms,
                              on_delivery=functools.partial(_report, done))

    def flush(self, timeout_s: float) -> None:
        self.producer.flush(timeout_s)  # (serves reports here too: either thread may answer a record)

    def close(self, force: bool) -> None:
        if force:
            self.producer.purge(in_queue=True, in_flight=True)
        else:
            self.producer.flush(30)
        self.stopping.set()
        self.thread.join()
        self.producer.poll(0)  # (purged records' reports: their ``done`` hears of it)
        self.producer.close()


class _QuietRepeats:
    """librdkafka's log, each facility's lines of a level said at that level once a minute, the rest at debug:
    with the broker down an idle client retries its connection (an error line) several times a second."""

    def __init__(self, logger: logging.Logger, every_s: float = 60.0) -> None:
        self.logger, self.every_s = logger, every_s
        self.said: dict[tuple[str, int], float] = {}

    def log(self, level: int, msg: str, facility: str, *args: object) -> None:
        now = time.monotonic()
        if now - self.said.get((facility, level), -self.every_s) < self.every_s:
            level = logging.DEBUG
        else:
            self.said[facility, level] = now
        self.logger.log(level, msg, facility, *args)


def _report(done: Done, err: Any, _message: Any) -> None:
    done(None if err is None else DeliveryFailed(err.str()))


class DeliveryFailed(Exception):
    """librdkafka reported a record not delivered (timed out, purged, refused by the broker)."""
