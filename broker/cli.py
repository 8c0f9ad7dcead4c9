"""Run the embedded Kafka-protocol broker (tansu, in memory) and create the streamrl topics."""

from __future__ import annotations

import argparse
import threading

from streamrl.child import serve_until_stopped, stop_on_signals
from streamrl.usage import check_port_free

from .embedded import EmbeddedBroker
from .topics import Topics

DESCRIPTION = """\
The embedded Kafka-protocol broker (tansu, in memory: what it holds is lost when it stops) with streamrl's
topics created: the single-machine default. For a durable log use a real Kafka cluster (infra/).

  streamrl broker --port 9092

Docs: docs/loop.md."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=9092, help="0 picks a free port")
    p.add_argument("--partitions", type=int, default=4, help="partitions of completions and rewards")
    p.add_argument("--topic-prefix", default="streamrl")


def run(args: argparse.Namespace) -> int:
    check_port_free(args.host, args.port, "--port")
    broker = EmbeddedBroker(args.host, args.port or None, topics=Topics(args.topic_prefix),
                            partitions=args.partitions).start()
    print(f"broker ready: --bootstrap-servers {broker.bootstrap_servers}", flush=True)
    stop = threading.Event()
    stop_on_signals(stop)
    if not serve_until_stopped(broker.proc, stop):
        print("broker exited", flush=True)
        return 1
    broker.stop()
    return 0
