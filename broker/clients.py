"""Kafka producer and consumer set-up shared by every part (kafka-python).

``log_producer.LogProducer`` builds on ``make_producer`` for servers that must never wait for Kafka.
"""

from __future__ import annotations

from typing import Any

from kafka import KafkaConsumer, KafkaProducer

DEFAULT_COMPRESSION = "zstd"


def make_producer(bootstrap_servers: str, *, compression: str | None = DEFAULT_COMPRESSION,
                  linger_ms: int = 5, max_block_ms: int = 60_000, acks: int | str = 1,
                  client_id: str = "streamrl", **extra: Any) -> KafkaProducer:
    """A producer tuned for many small-to-medium records: compressed batches, short linger."""
    return KafkaProducer(
        bootstrap_servers=bootstrap_servers,
        client_id=client_id,
        compression_type=compression,
        linger_ms=linger_ms,
        batch_size=1 << 20,
        max_request_size=16 << 20,
        acks=acks,
        max_block_ms=max_block_ms,
        retries=5,
        **extra,
    )


FETCH_MAX_WAIT_MS = 100
"""How long the broker may hold a fetch that finds nothing new. Kafka's default (500 ms) is no cost
with Kafka, whose long poll answers when a record arrives; the embedded broker answers it late
instead, so a shorter wait keeps finished groups and new policy versions prompt, and not much shorter,
since each wake-up of kafka-python's threads takes a server's GIL (measured: docs/gateway.md, "How it
keeps overhead low"; docs/trainer.md)."""


def make_consumer(bootstrap_servers: str, *, group_id: str | None, client_id: str = "streamrl",
                  auto_offset_reset: str = "earliest", **extra: Any) -> KafkaConsumer:
    """A consumer with manual offset commits. Callers ``assign()`` partitions themselves when they
    own offsets (the trainer), which also avoids the group-join wait of ``subscribe()``."""
    extra.setdefault("fetch_max_wait_ms", FETCH_MAX_WAIT_MS)
    return KafkaConsumer(
        bootstrap_servers=bootstrap_servers,
        group_id=group_id,
        client_id=client_id,
        enable_auto_commit=False,
        auto_offset_reset=auto_offset_reset,
        max_partition_fetch_bytes=16 << 20,
        fetch_max_bytes=64 << 20,
        **extra,
    )
