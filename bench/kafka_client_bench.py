"""CPU per record of the Kafka clients the gateway's record-producer process can send through
(``gateway/recording/kafka_producers.py``): kafka-python and librdkafka (confluent-kafka), each set up as the producer
process sets it up (``SenderConfig.connect``: acks=all, one request in flight, zstd, linger 20 ms) and driven
through the same ``RecordProducer`` interface ``Delivery`` uses.

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

from streamrl.broker.embedded import EmbeddedBroker
from streamrl.broker.topics import Topics
from streamrl.gateway.recording.kafka_producers import PRODUCER_CLIENTS
from streamrl.gateway.recording.log_producer import SenderConfig

TOPIC = "bench.completions"


def process_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def run(client: str, bootstrap: str, compression: str, keys: list[bytes], value: bytes, rate: float) -> float:
    """Microseconds of the process's CPU per record, from the first send to the last acknowledgement."""
    config = SenderConfig(bootstrap, None if compression == "none" else compression, 10_000, "bench", client=client)
    producer = config.connect()
    acked, lock = [0], threading.Lock()

    def done(exc: BaseException | None) -> None:
        if exc is None:
            with lock:
                acked[0] += 1

    for key in keys[:100]:  # connected, metadata known, batches warm
        producer.send(TOPIC, key, value, int(time.time() * 1000), done)
    producer.flush(30)
    acked[0] = 0
    cpu, start = process_cpu_s(), time.perf_counter()
    for i, key in enumerate(keys):
        producer.send(TOPIC, key, value, int(time.time() * 1000), done)
        if i % 10 == 9:
            time.sleep(max(0.0, start + (i + 1) / rate - time.perf_counter()))
    producer.flush(30)
    used = process_cpu_s() - cpu
    producer.close(force=False)
    if acked[0] != len(keys):
        raise SystemExit(f"{client}: {acked[0]} of {len(keys)} records acknowledged")
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
    half = args.record_bytes // 2
    value = os.urandom(half) + b"a" * (args.record_bytes - half)
    keys = [os.urandom(16).hex().encode() for _ in range(args.records)]
    runs: dict[str, list[float]] = {name: [] for name in PRODUCER_CLIENTS}
    with EmbeddedBroker(topics=Topics("bench")) as broker:
        for _ in range(args.rounds):
            for name in PRODUCER_CLIENTS:
                runs[name].append(run(name, broker.bootstrap_servers, args.compression, keys, value, args.rate))
    median = {name: statistics.median(v) for name, v in runs.items()}
    for name, value_us in median.items():
        print(f"{name:14s} {value_us:6.1f} us of CPU per record  (rounds: {', '.join(f'{x:.1f}' for x in runs[name])})"
              f"  {value_us / median['kafka-python']:.2f}x kafka-python")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs, "median_us": median}, f, indent=2)


if __name__ == "__main__":
    main()
