"""Every part's Kafka settings, declared once: where the brokers are, the topics' prefix, and how every Kafka
client streamrl makes authenticates and encrypts.

``KafkaSettings`` (``KafkaSecurity`` and the brokers' address and topic prefix) is each part's ``kafka`` field
(``GatewayConfig.kafka``, ``TrainerConfig.kafka``, ``JudgeConfig.kafka``, ``UpConfig.kafka``,
``ExportOptions.kafka``): a ``[trainer.kafka]``-style table in a config file, flags ``--bootstrap-servers``,
``--topic-prefix``, ``--kafka-security-protocol`` and so on. A part whose broker is optional (the gateway,
``streamrl up``) takes ``OptionalKafkaSettings``, whose default is no broker. ``KafkaSecurity`` alone is what ``broker/clients.py``
builds every producer, consumer and admin client from. The default is PLAINTEXT, what the embedded broker speaks.

Secrets: ``sasl_password`` may be given, but a config file (and the JSON ``streamrl up`` writes for its
parts) is a poor place for it; when it is not given the password is read from the environment variable
``sasl_password_env`` names (``STREAMRL_KAFKA_PASSWORD``) when a client is made. It never appears in a
repr, and ``redacted()`` is what may be logged.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Self

from streamrl.config_file import FLAT

PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


@dataclass(frozen=True, slots=True)
class KafkaSecurity:
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    """Kafka security protocol: PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL."""
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = None
    """SASL mechanism (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512) for the SASL protocols."""
    sasl_username: str | None = None
    sasl_password: str | None = field(default=None, repr=False)
    """Better left unset here: then it is read from the environment variable ``sasl_password_env``."""
    sasl_password_env: str = "STREAMRL_KAFKA_PASSWORD"
    """Environment variable the SASL password is read from when ``sasl_password`` is not given."""
    ssl_cafile: str | None = None
    """CA certificate (PEM) the brokers' certificates are checked against; None: the system's CAs."""
    ssl_certfile: str | None = None
    """Client certificate (PEM) for mutual TLS."""
    ssl_keyfile: str | None = None
    """The client certificate's private key (PEM)."""
    ssl_check_hostname: bool = True
    """Check that the broker's certificate names the host connected to."""

    def __post_init__(self) -> None:
        if self.security_protocol not in PROTOCOLS:
            raise ValueError(f"kafka.security_protocol must be one of {', '.join(PROTOCOLS)}, "
                             f"not {self.security_protocol!r}")
        if self.sasl:
            if self.sasl_mechanism not in MECHANISMS:
                raise ValueError(f"kafka.sasl_mechanism must be one of {', '.join(MECHANISMS)} with "
                                 f"{self.security_protocol}, not {self.sasl_mechanism!r}")
            if not self.sasl_username:
                raise ValueError(f"kafka.sasl_username is needed with {self.security_protocol}")
        elif self.sasl_mechanism or self.sasl_username or self.sasl_password:
            raise ValueError(f"SASL settings given but kafka.security_protocol is {self.security_protocol}")
        if not self.tls and (self.ssl_cafile or self.ssl_certfile or self.ssl_keyfile):
            raise ValueError(f"TLS files given but kafka.security_protocol is {self.security_protocol}")
        if bool(self.ssl_certfile) != bool(self.ssl_keyfile):
            raise ValueError("kafka.ssl_certfile and kafka.ssl_keyfile go together (mutual TLS)")

    @property
    def sasl(self) -> bool:
        return self.security_protocol.startswith("SASL_")

    @property
    def tls(self) -> bool:
        return self.security_protocol in ("SSL", "SASL_SSL")

    @classmethod
    def of(cls, value: KafkaSecurity | Mapping[str, Any] | None) -> Self:
        """From a config file's table (a dict; unknown keys are errors naming them) or as it is; another part's
        settings (``GatewayKafka`` where ``KafkaSettings`` is wanted) by their values, so that the class, which
        carries the part's defaults, is always the part's own."""
        if value is None:
            return cls()
        if type(value) is cls:
            return value
        if isinstance(value, KafkaSecurity):
            value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        if not isinstance(value, Mapping):
            raise ValueError(f"kafka settings must be a table, not {type(value).__name__}")
        unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown option(s) in [kafka]: {', '.join(unknown)}")
        return cls(**value)

    def client_kwargs(self, environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
        """The kafka-python keyword arguments (the same for producers, consumers and admin clients).
        Files are checked here, when a client is made, so that a typo fails with its path."""
        kw: dict[str, Any] = {"security_protocol": self.security_protocol}
        if self.tls:
            self._check_files()
            kw.update(ssl_cafile=self.ssl_cafile, ssl_certfile=self.ssl_certfile, ssl_keyfile=self.ssl_keyfile,
                      ssl_check_hostname=self.ssl_check_hostname)
        if self.sasl:
            kw.update(sasl_mechanism=self.sasl_mechanism, sasl_plain_username=self.sasl_username,
                      sasl_plain_password=self._password(environ))
        return kw

    def librdkafka_config(self, environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
        """The same settings in librdkafka's names (the record producer's ``librdkafka`` client). Without a CA
        file librdkafka is told to find the system's CAs (``probe``), as kafka-python uses them."""
        conf: dict[str, Any] = {"security.protocol": self.security_protocol}
        if self.tls:
            self._check_files()
            conf["ssl.ca.location"] = self.ssl_cafile or "probe"
            if self.ssl_certfile:
                conf.update({"ssl.certificate.location": self.ssl_certfile, "ssl.key.location": self.ssl_keyfile})
            conf["ssl.endpoint.identification.algorithm"] = "https" if self.ssl_check_hostname else "none"
        if self.sasl:
            conf.update({"sasl.mechanism": self.sasl_mechanism, "sasl.username": self.sasl_username,
                         "sasl.password": self._password(environ)})
        return conf

    def _check_files(self) -> None:
        for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise FileNotFoundError(f"kafka.{name}: no such file {path}")

    def _password(self, environ: Mapping[str, str]) -> str:
        password = self.sasl_password if self.sasl_password is not None else environ.get(self.sasl_password_env)
        if password is None:
            raise ValueError(f"no SASL password: set kafka.sasl_password or the environment variable "
                             f"{self.sasl_password_env}")
        return password

    def redacted(self) -> dict[str, Any]:
        """The settings as a dict with the password masked: what may be logged or written to disk."""
        values = dataclasses.asdict(self)
        if values["sasl_password"] is not None:
            values["sasl_password"] = "***"
        return values


@dataclass(frozen=True, slots=True)
class KafkaSettings(KafkaSecurity):
    """A part's whole Kafka table: the security settings, the brokers and the topics' prefix, so that no part
    declares them again. Their flags keep their names (``--bootstrap-servers``, ``--topic-prefix``: ``FLAT``);
    a part that can run without Kafka takes :class:`OptionalKafkaSettings` instead."""

    bootstrap_servers: str = field(default="127.0.0.1:9092", metadata={FLAT: "bootstrap_servers"})
    """Kafka bootstrap servers (host:port, comma-separated)."""
    topic_prefix: str = field(default="streamrl", metadata={FLAT: "topic_prefix"})
    """The topics' prefix (PREFIX.completions, PREFIX.rewards, PREFIX.policy, ...)."""


@dataclass(frozen=True, slots=True)
class OptionalKafkaSettings(KafkaSettings):
    """The Kafka table of a part that runs without one unless it is given: no broker by default (the gateway
    then forwards without logging; ``streamrl up`` starts its embedded broker). Subclassed per part
    (``GatewayKafka``, ``UpKafka``) so that each part's settings keep their own class."""

    bootstrap_servers: str | None = field(default=None, metadata={FLAT: "bootstrap_servers"})  # type: ignore[assignment]
    """Kafka bootstrap servers (host:port, comma-separated); unset: no Kafka (the gateway turns logging off,
    which ``--no-logging`` says; ``streamrl up`` starts its embedded broker)."""
