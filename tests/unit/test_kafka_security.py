"""Kafka security settings (``broker/security.py``) reach every Kafka client streamrl makes.

PLAINTEXT clients made for real against the embedded broker: ``tests/integration/test_kafka_security_clients.py``.
No SASL or TLS broker runs here, so for SASL_SSL the real kafka-python producer and consumer are built
without connecting (``api_version`` given, which skips the bootstrap probe) and their configs checked,
for the admin client (which connects as it is made) the keyword arguments it is built from, and the record
producer's librdkafka client is built with a real certificate and key (it loads them as it is made).
"""

from __future__ import annotations

import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from confluent_kafka import KafkaException

from streamrl.broker.clients import admin_kwargs, consumer_kwargs, make_consumer, make_producer
from streamrl.broker.embedded import free_port
from streamrl.broker.security import KafkaSecurity, KafkaSettings
from streamrl.cli import build_parser
from streamrl.cli.up_config import load_config as load_up_config
from streamrl.gateway.cli import config_from_args
from streamrl.gateway.config import GatewayConfig, GatewayKafka
from streamrl.gateway.recording.kafka_producers import KafkaUnreachable, connect
from streamrl.trainer.config import TrainerConfig

SASL_SSL = dict(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512", sasl_username="trainer")


@pytest.fixture
def tls_files(tmp_path: Path) -> dict[str, str]:
    files = {}
    for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
        path = tmp_path / f"{name}.pem"
        path.write_text("-----BEGIN PLACEHOLDER-----\n")  # never read: no TLS connection is made here
        files[name] = str(path)
    return files


def test_sasl_ssl_settings_reach_the_real_producer_and_consumer(tls_files) -> None:
    security = KafkaSecurity(**SASL_SSL, sasl_password="s3cret", **tls_files)
    producer = make_producer("127.0.0.1:1", security=security, api_version=(2, 5, 0))
    consumer = make_consumer("127.0.0.1:1", group_id=None, security=security, api_version=(2, 5, 0))
    try:
        for config in (producer.config, consumer.config):
            assert config["security_protocol"] == "SASL_SSL"
            assert (config["sasl_mechanism"], config["sasl_plain_username"], config["sasl_plain_password"]) == \
                ("SCRAM-SHA-512", "trainer", "s3cret")
            assert (config["ssl_cafile"], config["ssl_certfile"], config["ssl_keyfile"]) == \
                (tls_files["ssl_cafile"], tls_files["ssl_certfile"], tls_files["ssl_keyfile"])
            assert config["ssl_check_hostname"] is True
    finally:
        producer.close(timeout=0)
        consumer.close()
    kw = admin_kwargs("kafka:9093", security=security)
    assert (kw["security_protocol"], kw["sasl_plain_password"], kw["ssl_cafile"]) == \
        ("SASL_SSL", "s3cret", tls_files["ssl_cafile"])


def test_sasl_ssl_settings_reach_librdkafka(tmp_path: Path) -> None:
    """The record producer's librdkafka client is made with the settings in librdkafka's names: it loads the
    TLS files (a real self-signed certificate and key, made with openssl) and takes the SASL settings when it
    is built, so a name or file it refused would fail here; with no broker listening, connecting then fails
    as unreachable."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=localhost"], check=True, capture_output=True)
    security = KafkaSecurity(**SASL_SSL, sasl_password="s3cret", ssl_cafile=str(cert), ssl_certfile=str(cert),
                             ssl_keyfile=str(key), ssl_check_hostname=False)
    assert security.librdkafka_config() == {
        "security.protocol": "SASL_SSL", "ssl.ca.location": str(cert), "ssl.certificate.location": str(cert),
        "ssl.key.location": str(key), "ssl.endpoint.identification.algorithm": "none",
        "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "trainer", "sasl.password": "s3cret"}
    assert KafkaSecurity(security_protocol="SSL").librdkafka_config()["ssl.ca.location"] == "probe"
    with pytest.raises(KafkaUnreachable):
        connect("librdkafka", f"127.0.0.1:{free_port()}", security=security, compression="zstd", linger_ms=5,
                send_timeout_ms=1_000, client_id="test")
    key.write_text("-----BEGIN PLACEHOLDER-----\n")  # a broken key is a setting error, not an unreachable broker
    with pytest.raises(KafkaException, match="ssl"):
        connect("librdkafka", f"127.0.0.1:{free_port()}", security=security, compression="zstd", linger_ms=5,
                send_timeout_ms=1_000, client_id="test")


def test_password_comes_from_the_environment_and_is_never_shown() -> None:
    security = KafkaSecurity(**SASL_SSL)
    assert security.client_kwargs({"STREAMRL_KAFKA_PASSWORD": "from-env"})["sasl_plain_password"] == "from-env"
    with pytest.raises(ValueError, match="STREAMRL_KAFKA_PASSWORD"):
        security.client_kwargs({})
    shown = KafkaSettings(**SASL_SSL, sasl_password="s3cret")
    assert "s3cret" not in repr(shown) and shown.redacted()["sasl_password"] == "***"
    trainer = TrainerConfig(kafka=shown)
    assert "s3cret" not in trainer.describe() and "SCRAM-SHA-512" in trainer.describe()


@pytest.mark.parametrize("kw, message", [
    ({"security_protocol": "SASL"}, "security_protocol must be one of"),
    ({"security_protocol": "SASL_SSL", "sasl_username": "u"}, "sasl_mechanism must be one of"),
    ({"security_protocol": "SASL_SSL", "sasl_mechanism": "PLAIN"}, "sasl_username is needed"),
    ({"sasl_username": "u"}, "SASL settings given but"),
    ({"ssl_cafile": "/ca.pem"}, "TLS files given but"),
    ({"security_protocol": "SSL", "ssl_certfile": "/c.pem"}, "go together"),
])
def test_inconsistent_settings_are_refused(kw, message) -> None:
    with pytest.raises(ValueError, match=message):
        KafkaSecurity(**kw)


def test_a_missing_tls_file_is_named_when_a_client_is_made(tmp_path: Path) -> None:
    security = KafkaSecurity(security_protocol="SSL", ssl_cafile=str(tmp_path / "nope.pem"))
    with pytest.raises(FileNotFoundError, match=r"nope\.pem"):
        consumer_kwargs("kafka:9093", group_id=None, security=security)


def test_settings_come_from_flags_and_config_tables(tmp_path: Path) -> None:
    """One ``kafka`` table per part (``[gateway.kafka]``, ``[trainer.kafka]``, ``[up.kafka]``), or
    ``--kafka-*`` flags over it."""
    parser, _ = build_parser()
    path = tmp_path / "gateway.toml"
    path.write_text('[gateway]\nupstreams = ["http://u"]\n'
                    '[gateway.kafka]\nbootstrap_servers = "k:9093"\nsecurity_protocol = "SASL_SSL"\nsasl_mechanism = "PLAIN"\n'
                    'sasl_username = "gw"\n')
    args = parser.parse_args(["gateway", "--config", str(path), "--kafka-sasl-username", "gw2"])
    assert config_from_args(args).kafka == GatewayKafka(bootstrap_servers="k:9093", security_protocol="SASL_SSL",
                                                        sasl_mechanism="PLAIN", sasl_username="gw2")
    trainer = TrainerConfig.load(None, **tomllib.loads('[kafka]\nsecurity_protocol = "SSL"\n'))
    assert trainer.kafka.security_protocol == "SSL"
    with pytest.raises(ValueError, match=r"unknown option\(s\) in \[kafka\]: sasl_user"):
        TrainerConfig(kafka={"sasl_user": "x"})
    up_file = tmp_path / "up.toml"
    up_file.write_text('[up.kafka]\nsecurity_protocol = "SASL_SSL"\nsasl_mechanism = "PLAIN"\n'
                       'sasl_username = "up"\nsasl_password = "pw"\n')
    up = load_up_config(up_file, kafka={"sasl_mechanism": "SCRAM-SHA-256"})
    assert (up.kafka.sasl_mechanism, up.kafka.sasl_username) == ("SCRAM-SHA-256", "up")
    # what ``up`` hands its gateway and trainer: the same settings, the password only in their environment
    gateway = up.gateway_config(["http://u"], "k:9093", 1)
    trainer = up.trainer_config("model", "k:9093")
    assert gateway.kafka == GatewayKafka(bootstrap_servers="k:9093", security_protocol="SASL_SSL",
                                         sasl_mechanism="SCRAM-SHA-256", sasl_username="up")
    assert trainer.kafka == KafkaSettings(**gateway.kafka.redacted())
    assert up.child_env == {"STREAMRL_KAFKA_PASSWORD": "pw"}


def test_the_infra_sasl_ssl_example_loads() -> None:
    """``infra/kafka-sasl-ssl.toml`` is read by the same loaders the parts use (it cannot be run here)."""
    path = Path(__file__).parents[2] / "infra" / "kafka-sasl-ssl.toml"
    gateway = GatewayConfig.load(path, upstreams=("http://vllm-0:8000",))
    trainer = TrainerConfig.load(path)
    for security in (gateway.kafka, trainer.kafka):
        assert (security.security_protocol, security.sasl_mechanism) == ("SASL_SSL", "SCRAM-SHA-512")
        assert security.sasl_password is None and security.ssl_cafile == "/etc/streamrl/kafka-ca.pem"
    assert trainer.publisher in gateway.trusted_publishers
    assert gateway.adapter_root == trainer.adapters
