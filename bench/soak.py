"""Soak: minutes of mixed traffic through a real gateway (``streamrl gateway``, a child process) in front
of a real vLLM engine, while the broker is stopped and started again twice and the gateway is killed
with SIGKILL once. Every record the gateway was given and every reward it accepted must reach Kafka.

    .venv/bin/python bench/soak.py [--minutes 2] [--engine-url URL] [--json FILE]

Traffic: worker threads, each running trajectories of a few calls (chat, streamed chat, completions;
some with ``n`` = 2) and then posting the trajectory's reward. Offered = one record per choice of every
call answered 200; accepted = every reward answered 200. A collector reads both topics throughout and
keeps what it sees (by request id and choice, by trajectory id); at the end it must hold exactly what
was offered and accepted (duplicates, which at-least-once delivery allows, are counted, not matched).

Timeline (fractions of the run): broker stopped at 0.15, started at 0.30; gateway killed (SIGKILL to
its process, the way a crash or the OOM killer ends it) at 0.45 and started again at once; broker
stopped at 0.65, started at 0.80. The embedded broker keeps its log in memory, so a stop loses what it
holds (a Kafka cluster keeps it on disk): before each stop the traffic pauses until the collector has
read everything the gateway delivered, then resumes for the whole outage. The gateway kill is not
paused for: requests cut by it fail on the client's side (counted, not offered) and are not retried.

Reported: offered vs in Kafka, accepted vs in Kafka, lost (must be 0), duplicates, 5xx answers,
records offered per life of the gateway as the clients saw them against the gateway's own producer's
count (life 1: read just before the kill, so a lower bound), which tells records the gateway never
handed to its producer from records lost after it did,
connection errors (the gateway's restart), the gateway's RSS (its process and its producer process) at
the start and at the end of each of its two lives, and its spool counters.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from kafka import TopicPartition

from streamrl.broker.clients import make_consumer, make_producer
from streamrl.broker.embedded import EmbeddedBroker, free_port
from streamrl.broker.schema import CompletionRecord, RewardRecord, decode
from streamrl.broker.topics import Topics
from streamrl.child import spawn, stop_group, wait_http
from streamrl.engine.server import Engine, EngineConfig
from streamrl.tiny_model import build_model

CHAT = [{"role": "user", "content": "Count with me: one, two"}]
SENTINEL = b"soak-sentinel"
"""Written by the soak into every partition when the collector seems stuck (see ``nudge``)."""


class Collector:
    """Reads the completions and rewards topics of the (restartable) broker from the beginning; a
    broker restart starts an empty log, so it is read from the beginning again."""

    def __init__(self, bootstrap: str, topics: Topics) -> None:
        self.bootstrap, self.topics = bootstrap, topics
        self.completions: dict[tuple[str, int], int] = {}
        """(request id, choice) -> times seen."""
        self.rewards: dict[str, list[float]] = {}
        self.lock = threading.Lock()
        self.running = threading.Event()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def resume(self) -> None:
        self.stopped.clear()
        self.running.set()

    def pause(self) -> None:
        """Stop reading (before the broker stops); returns once the consumer is closed."""
        self.running.clear()
        self.stopped.wait()

    def holds(self, completions: set[tuple[str, int]], rewards: set[str]) -> bool:
        with self.lock:
            return completions.issubset(self.completions) and rewards.issubset(self.rewards)

    def _run(self) -> None:
        while True:
            self.running.wait()
            consumer = make_consumer(self.bootstrap, group_id=None)
            parts = []
            for topic in (self.topics.completions, self.topics.rewards):
                while not consumer.partitions_for_topic(topic):
                    time.sleep(0.1)
                parts += [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic)]
            consumer.assign(parts)
            consumer.seek_to_beginning(*parts)
            self.assigned = sorted((tp.topic, tp.partition) for tp in parts)
            while self.running.is_set():
                for batch in consumer.poll(timeout_ms=200).values():
                    with self.lock:
                        for m in batch:
                            if m.value == SENTINEL:
                                continue
                            rec = decode(m.value)
                            if isinstance(rec, CompletionRecord):
                                key = (rec.request_id, rec.choice_index)
                                self.completions[key] = self.completions.get(key, 0) + 1
                            elif isinstance(rec, RewardRecord):
                                self.rewards.setdefault(rec.trajectory_id, []).append(rec.reward)
            consumer.close()
            self.stopped.set()


class Traffic:
    """Worker threads making trajectories; what was offered and accepted, 5xx and connection errors."""

    def __init__(self, url: str, model: str, workers: int, seed: int = 0) -> None:
        self.url, self.model = url, model
        self.offered: set[tuple[str, int]] = set()
        self.kinds: dict[str, str] = {}
        self.life = 1
        """Which life of the gateway answered (set to 2 once the restarted one answers)."""
        self.per_life: dict[int, int] = {}
        """Records offered per life of the gateway, to set against its own producer's count."""
        """request id -> kind of call (for the report of what is missing)."""
        self.accepted: dict[str, float] = {}
        self.status_5xx: dict[int, int] = {}
        self.connection_errors = 0
        self.calls = 0
        self.lock = threading.Lock()
        self.go = threading.Event()
        self.go.set()
        self.idle = [threading.Event() for _ in range(workers)]
        self.done = threading.Event()
        self.threads = [threading.Thread(target=self._work, args=(i, seed + i), daemon=True) for i in range(workers)]
        for t in self.threads:
            t.start()

    def pause(self) -> None:
        """No new call starts; returns once the calls in flight have ended."""
        self.go.clear()
        for e in self.idle:
            e.wait()

    def resume(self) -> None:
        for e in self.idle:
            e.clear()
        self.go.set()

    def stop(self) -> None:
        self.done.set()
        self.go.set()
        for t in self.threads:
            t.join(120)

    def _gate(self, i: int) -> bool:
        if not self.go.is_set():
            self.idle[i].set()
            self.go.wait()
        return not self.done.is_set()

    def _call(self, client: httpx.Client, rng: random.Random, traj: str) -> None:
        kind = rng.choice(["chat", "chat", "stream", "completions"])
        n = 2 if rng.random() < 0.2 else 1
        headers = {"X-Trajectory-Id": traj}
        if kind == "completions":
            path, body = "/v1/completions", {"model": self.model, "prompt": "Once upon a time", "max_tokens": 8, "n": n}
        else:
            path, body = "/v1/chat/completions", {"model": self.model, "messages": CHAT, "max_tokens": 8, "n": n}
        try:
            if kind == "stream":
                body["stream"] = True
                with client.stream("POST", self.url + path, json=body, headers=headers) as r:
                    text = "".join(r.iter_text())
                    status, request_id = r.status_code, r.headers.get("x-request-id")
                    complete = text.rstrip().endswith("data: [DONE]")
            else:
                r = client.post(self.url + path, json=body, headers=headers)
                status, request_id, complete = r.status_code, r.headers.get("x-request-id"), True
        except httpx.HTTPError:  # the gateway killed and not yet back
            with self.lock:
                self.connection_errors += 1
            time.sleep(0.2)
            return
        with self.lock:
            self.calls += 1
            if status >= 500:
                self.status_5xx[status] = self.status_5xx.get(status, 0) + 1
            elif status == 200 and complete and request_id:
                self.offered.update((request_id, c) for c in range(n))
                self.kinds[request_id] = f"{kind} n={n} t={time.time():.3f} life={self.life}"
                self.per_life[self.life] = self.per_life.get(self.life, 0) + n

    def _work(self, i: int, seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(timeout=120) as client:
            t = 0
            while self._gate(i):
                traj = f"soak-{seed}-{t}"
                t += 1
                for _ in range(rng.randint(1, 3)):
                    if not self._gate(i):
                        return
                    self._call(client, rng, traj)
                reward = round(rng.random(), 6)
                try:
                    r = client.post(f"{self.url}/v1/rewards", json={"trajectory_id": traj, "reward": reward})
                except httpx.HTTPError:
                    with self.lock:
                        self.connection_errors += 1
                    time.sleep(0.2)
                    continue
                with self.lock:
                    if r.status_code >= 500:
                        self.status_5xx[r.status_code] = self.status_5xx.get(r.status_code, 0) + 1
                    elif r.status_code == 200:
                        self.accepted[traj] = reward


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            out += [int(child), *_children(int(child))]
    return out


def rss_mb(pid: int) -> dict[str, float]:
    """RSS of the gateway's process and of its children (the producer process), from /proc (Linux)."""
    return {"gateway": round(_rss_kb(pid) / 1024, 1),
            "children": round(sum(_rss_kb(c) for c in _children(pid)) / 1024, 1)}


def wait_for(check: Any, timeout_s: float, what: str) -> float:
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > timeout_s:
            raise RuntimeError(f"not within {timeout_s}s: {what}")
        time.sleep(0.1)
    return round(time.monotonic() - started, 2)


def engine_anomalies(engine_url: str) -> dict[str, int] | None:
    """What ``streamrl engine`` counted as captures gone wrong (``engine/capture.py`` ANOMALIES);
    None from a plain vLLM."""
    r = httpx.get(f"{engine_url}/streamrl/capture", timeout=10)
    return r.json().get("anomalies") if r.status_code == 200 else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=2.0)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--engine-url", help="an engine already running (default: start one on a tiny model)")
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--log-dir", default=str(Path(tempfile.gettempdir()) / "streamrl-soak"))
    args = ap.parse_args()
    logs = Path(args.log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="streamrl-soak-"))
    topics = Topics("soak")
    broker = EmbeddedBroker(topics=topics, partitions=4, log_file=logs / "broker.log").start()
    engine = None
    if args.engine_url is None:
        engine = Engine(EngineConfig(model=str(build_model(work / "model", "tiny", seed=0)), max_model_len=1024),
                        log_file=logs / "engine.log").start(timeout=600)
    engine_url = args.engine_url or engine.url
    model = httpx.get(f"{engine_url}/v1/models").json()["data"][0]["id"]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [str(Path(sys.executable).with_name("streamrl")), "gateway", "--upstream", engine_url,
           "--bootstrap-servers", broker.bootstrap_servers, "--port", str(port), "--topic-prefix", topics.prefix,
           "--no-follow-policy", "--spool-dir", str(work / "spool")]
    gateway = spawn(cmd, log=logs / "gateway.log")
    wait_http(url, 120, gateway, what="gateway")
    collector = Collector(broker.bootstrap_servers, topics)
    collector.resume()
    report: dict[str, Any] = {"minutes": args.minutes, "workers": args.workers, "events": []}
    total = args.minutes * 60
    started = time.monotonic()

    paused = [0.0]
    """Seconds the traffic was paused before broker stops: the timeline moves on by as much."""

    def at(fraction: float) -> None:
        time.sleep(max(0.0, started + paused[0] + fraction * total - time.monotonic()))

    def event(what: str, **extra: Any) -> None:
        report["events"].append({"t_s": round(time.monotonic() - started, 1), "event": what, **extra})
        print(f"[{time.monotonic() - started:6.1f}s] {what} {extra or ''}", flush=True)

    def caught_up() -> bool:
        with traffic.lock:
            offered, accepted = set(traffic.offered), set(traffic.accepted)
        return collector.holds(offered, accepted)

    def reread() -> set[tuple[str, int]]:
        """Every completion in the broker now, read afresh from the beginning (is the collector wrong?)."""
        consumer = make_consumer(broker.bootstrap_servers, group_id=None)
        parts = [TopicPartition(topics.completions, p) for p in consumer.partitions_for_topic(topics.completions)]
        consumer.assign(parts)
        consumer.seek_to_beginning(*parts)
        ends = consumer.end_offsets(parts)
        seen: set[tuple[str, int]] = set()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(consumer.position(tp) < ends[tp] for tp in parts):
            for batch in consumer.poll(timeout_ms=200).values():
                for m in batch:
                    if m.value == SENTINEL:
                        continue
                    rec = decode(m.value)
                    seen.add((rec.request_id, rec.choice_index))
        consumer.close()
        return seen

    def missing() -> dict[str, Any]:
        again = reread()
        with traffic.lock, collector.lock:
            records = traffic.offered - set(collector.completions)
            rewards = set(traffic.accepted) - set(collector.rewards)
            kinds: dict[str, int] = {}
            for request_id, choice in records:
                kinds[f"{request_id}/{choice}"] = traffic.kinds[request_id] + (
                    " (found on a fresh read)" if (request_id, choice) in again else " (not in the broker)")
            return {"records": len(records), "by_kind": kinds, "rewards": len(rewards),
                    "collector_partitions": collector.assigned, "fresh_total": len(again),
                    "collected": [len(collector.completions), len(collector.rewards)]}

    def nudge() -> None:
        """A record of the soak's own into every partition: whether records the collector has not seen
        become visible once they are no longer the last of their partition (a broker quirk) or are lost."""
        producer = make_producer(broker.bootstrap_servers, acks="all")
        for topic in (topics.completions, topics.rewards):
            for p in producer.partitions_for(topic):
                producer.send(topic, value=SENTINEL, partition=p)
        producer.flush()
        producer.close()

    def settle(what: str, timeout_s: float) -> float | None:
        """Wait until the collector holds everything offered and accepted; None (and the details in the
        report) when it does not within ``timeout_s``."""
        try:
            return wait_for(caught_up, 10, what)
        except RuntimeError:
            before = missing()
            nudge()
            try:
                waited = wait_for(caught_up, timeout_s, what)
                event("collector caught up only after a record was written behind the missing ones",
                      missing_before=before)
                return waited
            except RuntimeError:
                event("collector did not catch up", missing=missing(), missing_before_nudge=before)
                return None

    def stop_broker() -> None:
        traffic.pause()
        pause_started = time.monotonic()
        waited = settle("the collector to read what the gateway delivered", 10)
        paused[0] += time.monotonic() - pause_started
        collector.pause()
        broker.stop()
        traffic.resume()
        event("broker stopped", quiesce_s=waited)

    def start_broker() -> None:
        broker.start()
        collector.resume()
        event("broker started")

    time.sleep(2)  # the producer process up
    rss = {"first_start": rss_mb(gateway.pid)}
    traffic = Traffic(url, model, args.workers)
    try:
        event("traffic started")
        at(0.15)
        stop_broker()
        at(0.30)
        start_broker()
        at(0.45)
        rss["first_end"] = rss_mb(gateway.pid)
        report["gateway_producer_before_kill"] = httpx.get(f"{url}/health").json()["producer"]
        gateway.send_signal(signal.SIGKILL)  # the gateway's process; its producer process is left to finish
        gateway.wait()
        event("gateway killed (SIGKILL)")
        gateway = spawn(cmd, log=logs / "gateway.log")
        traffic.life = 2  # (a call answered just before the kill may be counted in life 2: a bound, not exact)
        wait_http(url, 120, gateway, what="gateway")
        event("gateway restarted")
        rss["second_start"] = rss_mb(gateway.pid)
        at(0.65)
        stop_broker()
        at(0.80)
        start_broker()
        at(1.0)
        traffic.stop()
        event("traffic stopped")
        health = httpx.get(f"{url}/health").json()
        drain_s = settle("everything offered to arrive", 110)
        rss["second_end"] = rss_mb(gateway.pid)
        health = httpx.get(f"{url}/health").json()
        anomalies = engine_anomalies(engine_url)
    finally:
        traffic.stop()
        stop_group(gateway, 30)
        collector.running.clear()
        broker.stop()
        if engine is not None:
            engine.stop()
        shutil.rmtree(work, ignore_errors=True)  # the tiny model and the spool
    got_completions = dict(collector.completions)
    got_rewards = dict(collector.rewards)
    lost_records = traffic.offered - set(got_completions)
    lost_rewards = set(traffic.accepted) - set(got_rewards)
    wrong_rewards = [t for t, r in traffic.accepted.items() if t in got_rewards and got_rewards[t][0] != r]
    report.update({
        "calls": traffic.calls,
        "records_offered": len(traffic.offered),
        "records_offered_per_gateway_life": traffic.per_life,
        "gateway_producer_offered_per_life": {
            "1": report.get("gateway_producer_before_kill", {}).get("offered"),
            "2": (health.get("producer") or {}).get("offered")},
        "records_in_kafka": len(set(got_completions) & traffic.offered),
        "records_lost": len(lost_records),
        "records_duplicated": sum(n - 1 for n in got_completions.values()),
        "records_unexpected": len(set(got_completions) - traffic.offered),
        "rewards_accepted": len(traffic.accepted),
        "rewards_in_kafka": len(set(got_rewards) & set(traffic.accepted)),
        "rewards_lost": len(lost_rewards),
        "rewards_wrong_value": len(wrong_rewards),
        "rewards_duplicated": sum(len(v) - 1 for v in got_rewards.values()),
        "status_5xx": traffic.status_5xx,
        "connection_errors": traffic.connection_errors,
        "drain_s": drain_s,
        "rss_mb": rss,
        "rss_growth_mb": {"first_life": round(rss["first_end"]["gateway"] - rss["first_start"]["gateway"], 1),
                          "second_life": round(rss["second_end"]["gateway"] - rss["second_start"]["gateway"], 1)},
        "gateway_health_at_end": {"producer": health.get("producer"), "spool": health.get("spool")},
        "engine_capture_anomalies": anomalies,
        "host": {"cpus": os.cpu_count(), "platform": platform.platform()},
    })
    report["ok"] = (report["records_lost"] == 0 and report["rewards_lost"] == 0 and not wrong_rewards
                    and not traffic.status_5xx)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(text + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
