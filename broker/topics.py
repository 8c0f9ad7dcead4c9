"""Topic names and creation. Every part names topics through ``Topics`` so one prefix moves them all."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kafka.admin import NewTopic
from kafka.errors import TopicAlreadyExistsError

from .clients import PLAINTEXT, make_admin
from .security import KafkaSecurity

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Topics:
    """The four topics. Completions and rewards are keyed by trajectory id; policy by policy name;
    gateways (the gateways' coordination log, ``gateway/coordination.py``) by gateway id."""

    prefix: str = "streamrl"

    @property
    def completions(self) -> str:
        return f"{self.prefix}.completions"

    @property
    def rewards(self) -> str:
        return f"{self.prefix}.rewards"

    @property
    def policy(self) -> str:
        return f"{self.prefix}.policy"

    @property
    def gateways(self) -> str:
        return f"{self.prefix}.gateways"


GATEWAYS_RETENTION_MS = 3_600_000
"""The coordination topic keeps an hour: every gateway rewrites its whole state each heartbeat, so only the
last few seconds matter (a real Kafka deletes the rest; the embedded broker keeps it in memory anyway)."""


def create_topics(bootstrap_servers: str, topics: Topics, *, partitions: int = 4, replication: int = 1,
                  security: KafkaSecurity = PLAINTEXT) -> None:
    """Create the topics if missing. Completions and rewards get the same partition count so that a
    trajectory's completions and reward land in partitions with the same number. The policy and gateways
    topics have one partition: versions, and the gateways' states, are totally ordered."""
    _create_missing(bootstrap_servers, security, [
        NewTopic(topics.completions, partitions, replication),
        NewTopic(topics.rewards, partitions, replication),
        NewTopic(topics.policy, 1, replication),
        gateways_topic(topics, replication),
    ])


def gateways_topic(topics: Topics, replication: int = 1) -> NewTopic:
    return NewTopic(topics.gateways, 1, replication, topic_configs={"retention.ms": str(GATEWAYS_RETENTION_MS)})


def create_gateways_topic(bootstrap_servers: str, topics: Topics, *, security: KafkaSecurity = PLAINTEXT) -> None:
    """The coordination topic alone, if missing (a gateway started on topics made before it existed)."""
    _create_missing(bootstrap_servers, security, [gateways_topic(topics)])


def _create_missing(bootstrap_servers: str, security: KafkaSecurity, wanted: list[NewTopic]) -> None:
    admin = make_admin(bootstrap_servers, security=security)
    try:
        existing = set(admin.list_topics())
        missing = [t for t in wanted if t.name not in existing]
        if missing:
            try:
                admin.create_topics(missing)
            except TopicAlreadyExistsError:
                log.info("topics already exist")
    finally:
        admin.close()
