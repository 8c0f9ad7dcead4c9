"""Publish an adapter directory as a version of a policy: a rollback, or an adapter trained elsewhere.

The gateways following the policy topic load it into every upstream and route the policy name to it,
exactly as they do a version the trainer published. The version defaults to one past the newest on the
topic; a version the gateways have already passed is ignored by them (versions only move forward), so a
rollback publishes the old adapter's directory under a new version number.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from streamrl.config_flags import add_config_flags, given

from .policy_log import PolicyLog, adapter_record
from .schema import WEIGHTS_FILE
from .security import KafkaSettings
from .topics import Topics

DESCRIPTION = """\
Publish an adapter directory as a new version of a policy: a rollback to an earlier version, or an adapter
trained elsewhere. The gateways load and route it as they do the trainer's versions.

  streamrl publish ADAPTER_DIR --name policy --bootstrap-servers 127.0.0.1:9092

Docs: docs/gateway.md."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("adapter", type=Path, help=f"a peft LoRA adapter directory (with {WEIGHTS_FILE})")
    p.add_argument("--base-model", required=True, help="the model the adapter was trained on (as the engines serve it)")
    p.add_argument("--name", default="policy", help="policy name (default policy)")
    p.add_argument("--version", type=int, help="version number (default: one past the newest on the topic)")
    p.add_argument("--publisher", default="streamrl-publish",
                   help="the record's publisher, for gateways with trusted_publishers (default streamrl-publish)")
    add_config_flags(p, PublishKafka)


@dataclass(frozen=True)
class PublishKafka:
    """``publish``'s one table, ``kafka``, so that its flags are every part's (``--bootstrap-servers``,
    ``--topic-prefix``, ``--kafka-*``), named by the same rule."""

    kafka: KafkaSettings = field(default_factory=KafkaSettings)


def kafka_from_args(args: argparse.Namespace) -> KafkaSettings:
    """The Kafka table the flags give."""
    return KafkaSettings.of(given(args, PublishKafka).get("kafka"))


def run(args: argparse.Namespace) -> int:
    if not (args.adapter / WEIGHTS_FILE).is_file():
        print(f"streamrl publish: {args.adapter} has no {WEIGHTS_FILE}: not a peft adapter directory", file=sys.stderr)
        return 2
    kafka = kafka_from_args(args)
    log = PolicyLog(kafka.bootstrap_servers, Topics(kafka.topic_prefix), client_id="streamrl-publish",
                    security=kafka, publisher=args.publisher)
    try:
        newest = log.last_version(args.name)
        version = args.version if args.version is not None else newest + 1
        if version < 1:
            print("streamrl publish: --version must be >= 1", file=sys.stderr)
            return 2
        if version <= newest:
            print(f"streamrl publish: warning: {args.name} v{newest} is already published; gateways ignore "
                  f"v{version} (publish the adapter under a new version to roll back)", file=sys.stderr)
        record = log.publish(adapter_record(args.name, version, args.adapter, args.base_model))
    finally:
        log.close()
    print(json.dumps({"name": record.name, "version": record.version, "path": record.path,
                      "sha256": record.sha256}))
    return 0
