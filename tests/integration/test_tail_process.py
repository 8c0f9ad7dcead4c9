"""The tail process (``gateway/tail_process.py``) against the embedded broker: what it reads, in order and once,
what it writes, before and after Kafka answers, and that it never outlives its parent."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import subprocess
import sys
import uuid

import pytest

from streamrl.broker.embedded import EmbeddedBroker, free_port
from streamrl.broker.topics import Topics, create_topics
from streamrl.gateway.tail_process import Records, Tail, TailProcess


@pytest.fixture
def fresh(broker: EmbeddedBroker) -> Topics:
    """Topics of their own (the policy and gateways topics have one partition each)."""
    topics = Topics(f"tails-{uuid.uuid4().hex[:8]}")
    create_topics(broker.bootstrap_servers, topics, partitions=1)
    return topics


class Seen:
    """A subscriber's records, and an event to await a count of them."""

    def __init__(self) -> None:
        self.records: Records = []
        self.ends = 0
        self.changed = asyncio.Event()

    def on_records(self, records: Records) -> None:
        self.records.extend(records)
        self.changed.set()

    def on_end(self) -> None:
        self.ends += 1
        self.changed.set()

    async def until(self, records: int = 0, ends: int = 0, timeout_s: float = 30.0) -> None:
        async with asyncio.timeout(timeout_s):
            while len(self.records) < records or self.ends < ends:
                self.changed.clear()
                await self.changed.wait()


async def test_reads_in_order_once_and_writes_return_offsets(broker, fresh):
    for value in (b"old-0", b"old-1"):  # on the topic before the tail starts
        await asyncio.to_thread(lambda v=value: _produce(broker, fresh.policy, v))
    tails = TailProcess(broker.bootstrap_servers)
    policy, gateways = Seen(), Seen()
    tails.subscribe(Tail(fresh.policy), policy.on_records, policy.on_end)  # before start: sent at start
    await tails.start()
    try:
        await policy.until(records=2, ends=1)
        assert [v for _, v in policy.records] == [b"old-0", b"old-1"]
        offsets = [await tails.write(fresh.policy, b"k", f"new-{i}".encode()) for i in range(3)]
        assert offsets == [2, 3, 4]
        await policy.until(records=5)
        # a second tail joins: the first goes on where it was (assigning a partition must not rewind it)
        tails.subscribe(Tail(fresh.gateways), gateways.on_records, gateways.on_end)
        await gateways.until(ends=1)
        assert await tails.write(fresh.gateways, None, b"state") == 0
        assert await tails.write(fresh.policy, None, b"new-3") == 5
        await gateways.until(records=1)
        await policy.until(records=6)
        assert [o for o, _ in policy.records] == list(range(6))
        assert [v for _, v in policy.records][2:] == [b"new-0", b"new-1", b"new-2", b"new-3"]
        assert gateways.records == [(0, b"state")] and policy.ends == 1 and gateways.ends == 1
        with pytest.raises(ValueError, match="tailed already"):
            tails.subscribe(Tail(fresh.policy), policy.on_records)
    finally:
        await tails.stop()


async def test_a_failing_subscriber_does_not_stop_the_others(broker, fresh):
    tails = TailProcess(broker.bootstrap_servers)
    good = Seen()

    def broken(records: Records) -> None:
        raise RuntimeError("a subscriber's bug")

    tails.subscribe(Tail(fresh.policy), broken)
    tails.subscribe(Tail(fresh.gateways), good.on_records)
    await tails.start()
    try:
        for i in range(3):
            await tails.write(fresh.policy, None, b"x")
            await tails.write(fresh.gateways, None, str(i).encode())
        await good.until(records=3)
        assert [v for _, v in good.records] == [b"0", b"1", b"2"]
    finally:
        await tails.stop()


async def test_writes_wait_for_kafka_and_reads_start_when_it_answers(tmp_path):
    """Started before its broker: a write waits in the child (the caller's timeout bounds it) and is made
    once Kafka answers; the tail then reads it."""
    late = EmbeddedBroker(port=free_port(), topics=Topics("tails-late"), partitions=1,
                          log_file=tmp_path / "broker.log")
    tails = TailProcess(late.bootstrap_servers, retry_s=0.2)
    seen = Seen()
    tails.subscribe(Tail(late.topics.policy), seen.on_records)
    await tails.start()
    try:
        with pytest.raises(TimeoutError):
            await tails.write(late.topics.policy, None, b"too early", timeout_s=0.5)
        writing = asyncio.ensure_future(tails.write(late.topics.policy, None, b"waited", timeout_s=60))
        await asyncio.to_thread(late.start)  # creates the topics too
        assert await writing >= 0
        await seen.until(records=1, timeout_s=60)
        assert b"waited" in [v for _, v in seen.records]
    finally:
        await tails.stop()
        late.stop()


def test_the_child_exits_with_its_parent(broker):
    """SIGKILL to the process that started it: the child sees its socket close and exits."""
    script = ("import asyncio, sys\n"
              "from streamrl.gateway.tail_process import TailProcess\n"
              "async def main():\n"
              f"    tails = TailProcess({broker.bootstrap_servers!r})\n"
              "    await tails.start()\n"
              "    print(tails.pid, flush=True)\n"
              "    await asyncio.Event().wait()\n"
              "if __name__ == '__main__':\n"
              "    asyncio.run(main())\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        pidfd = os.pidfd_open(child)  # readable once the child has exited
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        readable, _, _ = select.select([pidfd], [], [], 30)
        assert readable, "the tail process outlived its parent by 30 s"
        os.close(pidfd)
    finally:
        parent.kill()
        parent.wait()


def _produce(broker: EmbeddedBroker, topic: str, value: bytes) -> None:
    from streamrl.broker.clients import make_producer

    producer = make_producer(broker.bootstrap_servers, acks="all", linger_ms=0)
    try:
        producer.send(topic, value=value).get(timeout=30)
    finally:
        producer.close()
