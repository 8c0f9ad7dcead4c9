"""Kafka security settings (``broker/security.py``) on PLAINTEXT clients of every part, made for real against
the embedded broker, their kafka-python configs read back."""

from __future__ import annotations

from streamrl.broker.clients import make_admin
from streamrl.broker.embedded import EmbeddedBroker
from streamrl.broker.policy_log import PolicyLog
from streamrl.broker.security import KafkaSecurity
from streamrl.broker.topics import Topics
from streamrl.trainer.source import KafkaRecordSource


def test_plaintext_clients_of_every_part_carry_the_settings(broker: EmbeddedBroker) -> None:
    """The clients the trainer (source, policy log) and topic creation make, for real, from one setting."""
    security = KafkaSecurity()
    topics = Topics(broker.topics.prefix)
    admin = make_admin(broker.bootstrap_servers, security=security)
    admin.close()
    assert admin.config["security_protocol"] == "PLAINTEXT"
    log = PolicyLog(broker.bootstrap_servers, topics, security=security, publisher="me")
    try:
        assert log.producer.config["security_protocol"] == "PLAINTEXT" and log.security is security
    finally:
        log.close()
    source = KafkaRecordSource(broker.bootstrap_servers, topics, "kafka-security-test", security=security)
    try:
        assert source.consumer.config["security_protocol"] == "PLAINTEXT"
    finally:
        source.close()
