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
    """The three topics. Completions and rewards are keyed by trajectory id; policy by policy name."""

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


def create_topics(bootstrap_servers: str, topics: Topics, *, partitions: int = 4, replication: int = 1,
                  security: KafkaSecurity = PLAINTEXT) -> None:
    """Create the topics if missing. Completions and rewards get the same partition count so that a
    trajectory's completions and reward land in partitions with the same number. The policy topic has
    one partition: versions are totally ordered."""
    admin = make_admin(bootstrap_servers, security=security)
    try:
        wanted = [
            NewTopic(topics.completions, partitions, replication),
            NewTopic(topics.rewards, partitions, replication),
            NewTopic(topics.policy, 1, replication),
        ]
        existing = set(admin.list_topics())
        missing = [t for t in wanted if t.name not in existing]
        if missing:
            try:
                admin.create_topics(missing)
            except TopicAlreadyExistsError:
                log.info("topics already exist")
    finally:
        admin.close()
