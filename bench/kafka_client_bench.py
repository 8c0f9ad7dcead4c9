"""CPU per record of the Kafka client in the gateway's record-producer process: kafka-python, set up as the
producer process sets it up (``SenderConfig.connect``: acks=all, one request in flight, zstd, linger 20 ms),
against librdkafka through confluent-kafka with the same settings, where that package is installed (it is not a
dependency of streamrl: this bench measures whether it should be).

Each client sends ``--records`` records of ``--record-bytes`` (half random, half one repeated byte: token arrays
do not compress, text does), each with its own trajectory-id key, paced at ``--rate`` records/s to the embedded
broker, and waits for every acknowledgement. Reported per client: the process's CPU per record (every thread:
the caller's, the client's network threads), rounds interleaved, and the ratio of the medians to kafka-python's.

    python bench/kafka_client_bench.py            # 3,000 records of 14 KB at 1,000/s, 3 rounds, zstd
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import threading
import time
from collections.abc import Callable

from streamrl.broker.embedded import EmbeddedBroker
from streamrl.broker.log_producer import SenderConfig
from streamrl.broker.topics import Topics

TOPIC = "bench.completions"

Client = tuple[Callable[[bytes, bytes], None], Callable[[], None], Callable[[], None]]
"""send(key, value), flush (every record acknowledged), close."""


def process_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def kafka_python(bootstrap: str, compression: str, acked: list[int]) -> Client:
    producer = SenderConfig(bootstrap, None if compression == "none" else compression, 10_000, "bench").connect()
    lock = threading.Lock()

    def ok(_meta: object) -> None:
        with lock:
            acked[0] += 1

    def send(key: bytes, value: bytes) -> None:
        producer.send(TOPIC, key=key, value=value).add_callback(ok)

    return send, producer.flush, producer.close


def librdkafka(bootstrap: str, compression: str, acked: list[int]) -> Client:
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "acks": "all", "compression.type": compression, "linger.ms": 20,
                         "max.in.flight.requests.per.connection": 1, "enable.idempotence": False,
                         "batch.size": 1 << 20, "message.max.bytes": 16 << 20, "client.id": "bench"})

    def ok(err: object, _msg: object) -> None:
        if err is None:
            acked[0] += 1

    def send(key: bytes, value: bytes) -> None:
        producer.produce(TOPIC, value=value, key=key, on_delivery=ok)
        producer.poll(0)  # serves the acknowledgements that came in

    return send, lambda: producer.flush(30), lambda: None


Make = Callable[[str, str, list[int]], Client]
"""A client from the bootstrap servers, the compression and the acknowledgement counter it adds to."""


def run(make: Make, bootstrap: str, compression: str, keys: list[bytes], value: bytes, rate: float) -> float:
    """Microseconds of the process's CPU per record, from the first send to the last acknowledgement."""
    acked = [0]
    send, flush, close = make(bootstrap, compression, acked)
    for key in keys[:100]:  # connected, metadata known, batches warm
        send(key, value)
    flush()
    acked[0] = 0
    cpu, start = process_cpu_s(), time.perf_counter()
    for i, key in enumerate(keys):
        send(key, value)
        if i % 10 == 9:
            time.sleep(max(0.0, start + (i + 1) / rate - time.perf_counter()))
    flush()
    used = process_cpu_s() - cpu
    close()
    if acked[0] != len(keys):
        raise SystemExit(f"{make.__name__}: {acked[0]} of {len(keys)} records acknowledged")
    return used / len(keys) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=3000)
    p.add_argument("--record-bytes", type=int, default=14_000)
    p.add_argument("--rate", type=float, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compression", default="zstd", choices=("zstd", "lz4", "none"),
                   help="both clients' (the record producer's default: zstd)")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    clients: dict[str, Make] = {"kafka-python": kafka_python}
    try:
        import confluent_kafka  # noqa: F401

        clients["librdkafka"] = librdkafka
    except ImportError:
        print("confluent-kafka is not installed: kafka-python alone")
    half = args.record_bytes // 2
    value = os.urandom(half) + b"a" * (args.record_bytes - half)
    keys = [os.urandom(16).hex().encode() for _ in range(args.records)]
    runs: dict[str, list[float]] = {name: [] for name in clients}
    with EmbeddedBroker(topics=Topics("bench")) as broker:
        for _ in range(args.rounds):
            for name, make in clients.items():
                runs[name].append(run(make, broker.bootstrap_servers, args.compression, keys, value, args.rate))
    median = {name: statistics.median(v) for name, v in runs.items()}
    for name, value_us in median.items():
        print(f"{name:14s} {value_us:6.1f} us of CPU per record  (rounds: {', '.join(f'{x:.1f}' for x in runs[name])})"
              f"  {value_us / median['kafka-python']:.2f}x kafka-python")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs, "median_us": median}, f, indent=2)


if __name__ == "__main__":
    main()
