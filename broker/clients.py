"""Kafka producer, consumer and admin client set-up shared by every part (kafka-python).

Every Kafka client streamrl makes is made here, with the part's ``KafkaSecurity`` (``security.py``:
protocol, SASL, TLS files), so that a secured cluster needs its settings given once per part and no
client can be made without them. ``log_producer.LogProducer`` builds on ``make_producer`` for servers
that must never wait for Kafka.
"""

from __future__ import annotations

from typing import Any

from kafka import KafkaConsumer, KafkaProducer
from kafka.admin import KafkaAdminClient

from .security import KafkaSecurity

DEFAULT_COMPRESSION = "zstd"
PLAINTEXT = KafkaSecurity()
RECONNECT_BACKOFF_MAX_MS = 1_000
"""The longest wait between a client's tries to reach a broker that went away (Kafka's Java clients' default).
kafka-python's is 30 s: after an outage a part could wait up to half a minute past the broker's return before it
produced or fetched again."""


def producer_kwargs(bootstrap_servers: str, *, security: KafkaSecurity = PLAINTEXT,
                    compression: str | None = DEFAULT_COMPRESSION, linger_ms: int = 5, max_block_ms: int = 60_000,
                    acks: int | str = 1, client_id: str = "streamrl", **extra: Any) -> dict[str, Any]:
    """What ``make_producer`` hands kafka-python (tests read it: no SASL broker runs here)."""
    extra.setdefault("reconnect_backoff_max_ms", RECONNECT_BACKOFF_MAX_MS)
    return dict(bootstrap_servers=bootstrap_servers, client_id=client_id, compression_type=compression,
                linger_ms=linger_ms, batch_size=1 << 20, max_request_size=16 << 20, acks=acks,
                max_block_ms=max_block_ms, retries=5, **security.client_kwargs(), **extra)


def make_producer(bootstrap_servers: str, *, security: KafkaSecurity = PLAINTEXT,
                  compression: str | None = DEFAULT_COMPRESSION, linger_ms: int = 5, max_block_ms: int = 60_000,
                  acks: int | str = 1, client_id: str = "streamrl", **extra: Any) -> KafkaProducer:
    """A producer tuned for many small-to-medium records: compressed batches, short linger."""
    return KafkaProducer(**producer_kwargs(bootstrap_servers, security=security, compression=compression,
                                           linger_ms=linger_ms, max_block_ms=max_block_ms, acks=acks,
                                           client_id=client_id, **extra))


FETCH_MAX_WAIT_MS = 100
"""How long the broker may hold a fetch that finds nothing new. Kafka's default (500 ms) is no cost
with Kafka, whose long poll answers when a record arrives; the embedded broker answers it late
instead, so a shorter wait keeps finished groups and new policy versions prompt, and not much shorter,
since each wake-up of kafka-python's threads takes their process's GIL (measured: docs/gateway.md, "How it
keeps overhead low"; docs/trainer.md)."""


POLL_ALL = 1 << 30
"""``max_records`` for ``KafkaConsumer.poll``: a fetch is taken whole, so that a consumer that pauses
partitions (the trainer's ``backlog = "wait"``, the export) never leaves records of a partly consumed fetch
behind: kafka-python 3.0.12 parks those on ``pause`` and may never hand them out nor fetch that partition
again (seen in the export's tests). What one poll returns is bounded by the fetch sizes below."""


def consumer_kwargs(bootstrap_servers: str, *, group_id: str | None, security: KafkaSecurity = PLAINTEXT,
                    client_id: str = "streamrl", auto_offset_reset: str = "earliest", **extra: Any) -> dict[str, Any]:
    """What ``make_consumer`` hands kafka-python (``extra`` may override the fetch sizes)."""
    extra.setdefault("fetch_max_wait_ms", FETCH_MAX_WAIT_MS)
    extra.setdefault("max_partition_fetch_bytes", 16 << 20)
    extra.setdefault("fetch_max_bytes", 64 << 20)
    extra.setdefault("reconnect_backoff_max_ms", RECONNECT_BACKOFF_MAX_MS)
    return dict(bootstrap_servers=bootstrap_servers, group_id=group_id, client_id=client_id,
                enable_auto_commit=False, auto_offset_reset=auto_offset_reset, **security.client_kwargs(), **extra)


def make_consumer(bootstrap_servers: str, *, group_id: str | None, security: KafkaSecurity = PLAINTEXT,
                  client_id: str = "streamrl", auto_offset_reset: str = "earliest", **extra: Any) -> KafkaConsumer:
    """A consumer with manual offset commits. Callers ``assign()`` partitions themselves when they
    own offsets (the trainer), which also avoids the group-join wait of ``subscribe()``."""
    return KafkaConsumer(**consumer_kwargs(bootstrap_servers, group_id=group_id, security=security,
                                           client_id=client_id, auto_offset_reset=auto_offset_reset, **extra))


def admin_kwargs(bootstrap_servers: str, *, security: KafkaSecurity = PLAINTEXT,
                 client_id: str = "streamrl-admin", **extra: Any) -> dict[str, Any]:
    """What ``make_admin`` hands kafka-python."""
    extra.setdefault("reconnect_backoff_max_ms", RECONNECT_BACKOFF_MAX_MS)
    return dict(bootstrap_servers=bootstrap_servers, client_id=client_id, **security.client_kwargs(), **extra)


def make_admin(bootstrap_servers: str, *, security: KafkaSecurity = PLAINTEXT,
               client_id: str = "streamrl-admin", **extra: Any) -> KafkaAdminClient:
    """An admin client (topic creation)."""
    return KafkaAdminClient(**admin_kwargs(bootstrap_servers, security=security, client_id=client_id, **extra))
