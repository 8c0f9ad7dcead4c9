"""Every part's Kafka settings are one table, declared once (``broker/security.py``'s ``KafkaSettings``): the
brokers, the topics' prefix and the security, as ``[<part>.kafka]`` in a file and ``config.kafka`` in code,
their flags spelt as they always were, each part keeping its own default broker."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from streamrl.broker.export import ExportOptions
from streamrl.broker.export_cli import options_from_args
from streamrl.broker.publish_cli import kafka_from_args as publish_kafka
from streamrl.broker.security import KafkaSettings
from streamrl.cli import build_parser
from streamrl.cli.up import flags_from_args
from streamrl.cli.up_config import UpConfig, UpKafka
from streamrl.cli.up_config import load_config as load_up_config
from streamrl.config_file import ConfigError
from streamrl.config_flags import add_config_flags, given
from streamrl.gateway.cli import config_from_args as gateway_from_args
from streamrl.gateway.config import GatewayConfig, GatewayKafka
from streamrl.judge.config import JudgeConfig
from streamrl.trainer.config import TrainerConfig
from streamrl.usage import UsageError, unreachable_kafka

SASL = {"security_protocol": "SASL_SSL", "sasl_mechanism": "PLAIN", "sasl_username": "u"}


def test_one_file_gives_two_parts_their_kafka_tables(tmp_path: Path) -> None:
    path = tmp_path / "stack.toml"
    path.write_text('[gateway]\nupstreams = ["http://u"]\n'
                    '[gateway.kafka]\nbootstrap_servers = "k:9093"\ntopic_prefix = "prod"\n'
                    'security_protocol = "SASL_SSL"\nsasl_mechanism = "PLAIN"\nsasl_username = "gw"\n'
                    '[trainer.kafka]\nbootstrap_servers = "k:9093"\ntopic_prefix = "prod"\n'
                    '[judge.kafka]\ntopic_prefix = "prod"\n')
    gateway, trainer, judge = GatewayConfig.load(path), TrainerConfig.load(path), JudgeConfig.load(path)
    assert gateway.kafka == GatewayKafka(bootstrap_servers="k:9093", topic_prefix="prod", **{**SASL,
                                                                                              "sasl_username": "gw"})
    assert trainer.kafka == KafkaSettings(bootstrap_servers="k:9093", topic_prefix="prod")
    assert judge.kafka == KafkaSettings(topic_prefix="prod")  # the judge's default broker, the file's prefix
    # flat overrides (the flags' names) go over the file's table, key by key
    trainer = TrainerConfig.load(path, topic_prefix="other", kafka_security_protocol="SSL")
    assert (trainer.kafka.bootstrap_servers, trainer.kafka.topic_prefix, trainer.kafka.security_protocol) == (
        "k:9093", "other", "SSL")


@pytest.mark.parametrize("argv, part", [
    (["gateway", "--upstream", "http://u"], "gateway"),
    (["trainer"], "trainer"),
    (["judge"], "judge"),
    (["sft", "data.jsonl"], "trainer"),
    (["batches", "--to", "out"], "trainer"),
])
def test_the_flags_keep_their_names_and_land_in_the_kafka_table(argv: list[str], part: str) -> None:
    parser, _ = build_parser()
    args = parser.parse_args([*argv, "--bootstrap-servers", "k:1", "--topic-prefix", "p",
                              "--kafka-security-protocol", "SASL_SSL", "--kafka-sasl-mechanism", "PLAIN",
                              "--kafka-sasl-username", "u"])
    if part == "gateway":
        kafka = gateway_from_args(args).kafka
    else:
        cls = TrainerConfig if part == "trainer" else JudgeConfig
        kafka = cls.load(None, **given(args, cls)).kafka
    assert (kafka.bootstrap_servers, kafka.topic_prefix, kafka.security_protocol, kafka.sasl_username) == (
        "k:1", "p", "SASL_SSL", "u")


def test_export_publish_and_up_take_the_same_flags() -> None:
    parser, _ = build_parser()
    flags = ["--bootstrap-servers", "k:1", "--topic-prefix", "p", "--kafka-security-protocol", "SSL"]
    options = options_from_args(parser.parse_args(["export", "out.jsonl", *flags]))
    assert options.kafka == KafkaSettings(bootstrap_servers="k:1", topic_prefix="p", security_protocol="SSL")
    published = parser.parse_args(["publish", "adapter", "--base-model", "m", *flags])
    assert publish_kafka(published) == options.kafka
    assert publish_kafka(parser.parse_args(["publish", "adapter", "--base-model", "m"])) == KafkaSettings()
    up = load_up_config(None, **flags_from_args(parser.parse_args(["up", *flags])))
    assert up.kafka == UpKafka(bootstrap_servers="k:1", topic_prefix="p", security_protocol="SSL")
    # what ``up`` hands every part it starts: the broker in use and its own prefix and security
    gateway, trainer = up.gateway_config(["http://u"], "k:1", 1), up.trainer_config("m", "k:1")
    judge = JudgeConfig(kafka=up.child_kafka("k:1"))
    for kafka in (gateway.kafka, trainer.kafka, judge.kafka):
        assert (kafka.bootstrap_servers, kafka.topic_prefix, kafka.security_protocol) == ("k:1", "p", "SSL")
    assert load_up_config(None, bootstrap_servers="k:2").kafka.bootstrap_servers == "k:2"  # flat names too


def test_a_setting_left_at_a_parts_top_level_is_told_where_it_went(tmp_path: Path) -> None:
    for part, key, cls in (("gateway", "bootstrap_servers", GatewayConfig), ("trainer", "topic_prefix", TrainerConfig),
                           ("judge", "bootstrap_servers", JudgeConfig)):
        path = tmp_path / f"{part}.toml"
        path.write_text(f'[{part}]\n{key} = "x"\n')
        with pytest.raises(ConfigError, match=rf"{part}.toml:2:1: unknown option '{key}' in \[{part}\] "
                                              rf"\(did you mean \[{part}.kafka\] {key}\?\)"):
            cls.load(path, upstreams=("http://u",)) if cls is GatewayConfig else cls.load(path)
    path = tmp_path / "up.toml"
    path.write_text('[up]\nbootstrap_servers = "k:1"\n')
    with pytest.raises(ConfigError, match=r"did you mean \[up.kafka\] bootstrap_servers\?"):
        load_up_config(path)
    path.write_text('[trainer]\nbootstrap_servers = "k:1"\n')  # up sets its trainer's broker itself
    with pytest.raises(UsageError, match=r"\[trainer\]: bootstrap_servers is set by up itself"):
        load_up_config(path)


def test_each_part_keeps_its_own_default_broker(tmp_path: Path) -> None:
    """The gateway and ``up`` have none (no logging; the embedded broker), the others 127.0.0.1:9092, also when
    their table sets only security settings."""
    path = tmp_path / "security.toml"
    path.write_text('[kafka]\nsecurity_protocol = "SSL"\n')
    gateway = GatewayConfig.load(path, upstreams=("http://u",))
    assert gateway.kafka.bootstrap_servers is None and not gateway.logging_enabled
    assert GatewayConfig(upstreams=("http://u",), kafka={"security_protocol": "SSL"}).kafka.bootstrap_servers is None
    assert UpConfig(work_dir=str(tmp_path)).kafka.bootstrap_servers is None
    for kafka in (TrainerConfig.load(path).kafka, JudgeConfig.load(path).kafka, ExportOptions().kafka):
        assert type(kafka) is KafkaSettings and kafka.bootstrap_servers == "127.0.0.1:9092"
    assert {c().kafka.topic_prefix for c in (TrainerConfig, JudgeConfig, ExportOptions)} == {"streamrl"}
    # another part's settings become the part's own class, with their values
    assert type(TrainerConfig(kafka=GatewayKafka(bootstrap_servers="k:1")).kafka) is KafkaSettings
    helps = {}
    for part, cls in (("trainer", TrainerConfig), ("gateway", GatewayConfig)):
        p = argparse.ArgumentParser()
        add_config_flags(p, cls)
        helps[part] = {a.option_strings[0]: a.help for a in p._actions}
    assert "(default 127.0.0.1:9092)" in helps["trainer"]["--bootstrap-servers"]
    assert "turns logging off" in helps["gateway"]["--bootstrap-servers"]
    assert "security protocol" in helps["gateway"]["--kafka-security-protocol"]  # the inherited fields' docs too


def test_the_password_is_masked_wherever_the_settings_are_shown() -> None:
    kafka = {**SASL, "bootstrap_servers": "k:1", "sasl_password": "s3cret"}
    trainer, judge = TrainerConfig(kafka=kafka), JudgeConfig(kafka=kafka)
    gateway = GatewayConfig(upstreams=("http://u",), kafka=kafka)
    for text in (trainer.describe(), judge.describe()):
        assert "s3cret" not in text and "***" in text and "k:1" in text
    assert "  kafka.bootstrap_servers = 'k:1'" in trainer.describe()
    assert "s3cret" not in repr(gateway) and gateway.kafka.redacted()["sasl_password"] == "***"
    up = UpConfig(work_dir="/tmp/x", kafka=kafka)  # up writes its parts' files without it
    assert up.child_kafka("k:1")["sasl_password"] is None and up.child_env == {"STREAMRL_KAFKA_PASSWORD": "s3cret"}
    assert dataclasses.asdict(up.gateway_config(["http://u"], "k:1", 1))["kafka"]["sasl_password"] is None


def test_a_one_shot_command_that_reaches_no_broker_says_so_in_one_line() -> None:
    """``publish`` and ``export`` against an address where no broker answers: kafka-python's bootstrap timeout
    (30 s, so not run here: the error is the one its clients raise) becomes one line naming the flag."""
    from kafka.errors import KafkaTimeoutError

    message = unreachable_kafka(KafkaTimeoutError("Unable to bootstrap from 127.0.0.1:9"))
    assert message is not None and "127.0.0.1:9" in message and "--bootstrap-servers" in message
    assert unreachable_kafka(KafkaTimeoutError("Timeout after 60000 ms waiting to send")) is None  # not this
    assert unreachable_kafka(ValueError("bootstrap")) is None


def test_every_kafka_client_retries_a_lost_broker_within_a_second_unless_told_otherwise() -> None:
    """kafka-python backs off up to 30 s between tries to reach a broker that went away; every client streamrl
    makes tries at least once a second, so that a part is back within a second of the broker's return."""
    from streamrl.broker.clients import (
        RECONNECT_BACKOFF_MAX_MS,
        admin_kwargs,
        consumer_kwargs,
        producer_kwargs,
    )

    assert RECONNECT_BACKOFF_MAX_MS == 1_000
    for kw in (producer_kwargs("b:9092"), consumer_kwargs("b:9092", group_id=None), admin_kwargs("b:9092")):
        assert kw["reconnect_backoff_max_ms"] == RECONNECT_BACKOFF_MAX_MS
    assert producer_kwargs("b:9092", reconnect_backoff_max_ms=5)["reconnect_backoff_max_ms"] == 5
    assert consumer_kwargs("b:9092", group_id=None, reconnect_backoff_max_ms=5)["reconnect_backoff_max_ms"] == 5
