"""The gateway's fire-and-forget producer: everything offered is delivered or counted, never blocks."""

from __future__ import annotations

import functools
import multiprocessing
import os
import pickle
import subprocess
import sys
import threading
import time

import pytest
from support.kafka_reader import TopicReader

from streamrl.broker.embedded import EmbeddedBroker
from streamrl.broker.schema import RewardRecord, decode, encode
from streamrl.broker.topics import Topics, create_topics
from streamrl.gateway.frame_pipe import FRAME, FrameReader, PipeWriter
from streamrl.gateway.recording.log_producer import LogProducer, check_builders, decode_item, parts_frame


def _reward_records(tag: str, n: int) -> list[tuple[bytes | None, bytes]]:
    """A deferred build: made in the producer process, so it must be a picklable module-level function."""
    return [(f"{tag}-{i}".encode(), encode(RewardRecord(trajectory_id=f"{tag}-{i}", reward=float(i))))
            for i in range(n)]


def _fails(*_parts: bytes) -> list[tuple[bytes | None, bytes]]:
    raise ValueError("cannot build")


def _reward_parts(tag: bytes, rewards: bytes) -> list[tuple[bytes | None, bytes]]:
    """A builder of parts (``offer_parts``): one reward record per byte of ``rewards``."""
    return [(f"{tag.decode()}-{i}".encode(), encode(RewardRecord(trajectory_id=f"{tag.decode()}-{i}", reward=float(r))))
            for i, r in enumerate(rewards)]


@pytest.mark.parametrize("process", [True, False], ids=["process", "thread"])
def test_records_offered_as_parts_are_delivered_or_counted(broker: EmbeddedBroker, process: bool) -> None:
    """``offer_parts``: byte strings and a module-level builder travel to the producer (process or thread);
    the records it builds are delivered; a builder that raises counts its records invalid, one not declared
    to a producer process is refused at the door."""
    topics = Topics("log-producer-parts")
    create_topics(broker.bootstrap_servers, topics, partitions=1)
    reader = TopicReader(broker.bootstrap_servers, topics.rewards)
    tag = os.urandom(4).hex()
    producer = LogProducer(broker.bootstrap_servers, process=process, builders=(_reward_parts, _fails))
    try:
        for i in range(20):
            assert producer.offer_parts(topics.rewards, _reward_parts, (f"{tag}-{i}".encode(), bytes(range(3))), 3)
        assert producer.offer_parts(topics.rewards, _fails, (b"x" * 100_000,), 2)
        refused = producer.offer_parts(topics.rewards, lambda *parts: [], (b"x",), 4)
        assert refused is not process  # not declared to the process (a lambda could not be); a thread takes it
    finally:
        producer.close()
    stats = producer.stats
    assert (stats.offered, stats.delivered, stats.undelivered) == (66, 60, 0)
    assert stats.invalid == (6 if process else 2)
    got = reader.wait_for(lambda r: isinstance(r, RewardRecord) and r.trajectory_id.startswith(tag), count=60)
    assert sorted((r.trajectory_id, r.reward) for r in got) == sorted(
        (f"{tag}-{i}-{j}", float(j)) for i in range(20) for j in range(3))


def test_frames_of_parts_decode_and_malformed_ones_are_refused() -> None:
    """A frame of parts comes out as the topic, the declared builder bound to the parts, and the record count;
    a frame cut short, or naming a builder not declared, is a ``ValueError`` (the process counts it)."""
    parts = (b"tag", bytes([1, 2]))
    builders = (_fails, _reward_parts)
    frame = b"".join(parts_frame("t.rewards", 1, parts, 2))
    topic, key, build, count = decode_item(frame, builders)
    assert (topic, key, count) == ("t.rewards", None, 2)
    assert [k for k, _ in build()] == [b"tag-0", b"tag-1"]
    assert decode_item(pickle.dumps(("t", b"k", b"v", 1), protocol=5)) == ("t", b"k", b"v", 1)
    with pytest.raises(ValueError, match="parts"):
        decode_item(frame[:-1], builders)
    unknown = b"".join(parts_frame("t", 2, parts, 2))
    with pytest.raises(ValueError, match="builder"):
        decode_item(unknown, builders)
    with pytest.raises(ValueError, match="module-level"):
        check_builders([lambda: []])
    with pytest.raises(ValueError, match="module-level"):
        LogProducer("127.0.0.1:1", process=True, builders=(_reward_parts, lambda: []))


def test_process_producer_delivers_plain_and_deferred_records(broker: EmbeddedBroker) -> None:
    # a topic of its own: other tests read the session broker's rewards topic for records of any id
    topics = Topics("log-producer")
    create_topics(broker.bootstrap_servers, topics, partitions=1)
    topic = topics.rewards
    reader = TopicReader(broker.bootstrap_servers, topic)
    tag = os.urandom(4).hex()
    producer = LogProducer(broker.bootstrap_servers, process=True)
    try:
        for i in range(50):
            rec = RewardRecord(trajectory_id=f"{tag}-plain-{i}", reward=1.0)
            assert producer.offer(topic, rec.trajectory_id.encode(), encode(rec))
        assert producer.offer_deferred(topic, functools.partial(_reward_records, f"{tag}-built", 30), 30)
        assert producer.offer_deferred(topic, _fails, 2)
        assert not producer.offer_deferred(topic, lambda: [], 3)  # cannot travel to the process: invalid
    finally:
        producer.close()
    stats = producer.stats
    assert (stats.offered, stats.delivered, stats.invalid, stats.undelivered) == (85, 80, 5, 0)
    got = reader.wait_for(lambda r: isinstance(r, RewardRecord) and r.trajectory_id.startswith(tag), count=80)
    assert {r.trajectory_id for r in got} == {f"{tag}-plain-{i}" for i in range(50)} | {
        f"{tag}-built-{i}" for i in range(30)}


def test_producer_process_says_when_it_reads_the_pipe(broker: EmbeddedBroker) -> None:
    """``wait_ready``: not at once (the child still starts its interpreter and imports), then within the bound;
    a gateway waits for it before it serves (``conftest.start_gateway`` checks that)."""
    producer = LogProducer(broker.bootstrap_servers, process=True)
    try:
        assert not producer.wait_ready(0)
        assert producer.wait_ready(60)
    finally:
        producer.close()
    threaded = LogProducer(broker.bootstrap_servers)
    try:
        assert threaded.wait_ready(0)  # thread mode: its thread is there at once
    finally:
        threaded.close()


@pytest.mark.skipif(not hasattr(os, "sched_getscheduler"), reason="Linux scheduling policies")
def test_producer_process_threads_run_as_batch(broker: EmbeddedBroker) -> None:
    """Every thread of the producer process (pipe reader, Kafka network and delivery threads) runs under
    SCHED_BATCH, so none of its wake-ups preempts the server's event loop; the server's own thread does not."""
    before = {p.pid for p in multiprocessing.active_children()}
    producer = LogProducer(broker.bootstrap_servers, process=True)
    try:
        topic = Topics("log-producer-batch").rewards
        rec = RewardRecord(trajectory_id="batch-0", reward=1.0)
        assert producer.offer(topic, b"batch-0", encode(rec))
        deadline = time.monotonic() + 60
        while producer.stats.delivered < 1 and time.monotonic() < deadline:  # its Kafka threads are up
            time.sleep(0.05)
        assert producer.stats.delivered == 1
        child = next(p for p in multiprocessing.active_children()
                     if p.pid not in before and p.name == "streamrl-log-producer")
        threads = [int(t) for t in os.listdir(f"/proc/{child.pid}/task")]
        assert len(threads) > 2
        assert {os.sched_getscheduler(t) for t in threads} == {os.SCHED_BATCH}
        assert os.sched_getscheduler(0) == os.SCHED_OTHER
    finally:
        producer.close()


def _pipe_writer(**bounds: int) -> tuple[int, PipeWriter]:
    """The server's side of the pipe to the producer process, on a fresh pipe; and the pipe's read end."""
    read_fd, write_fd = os.pipe()

    class Conn:  # the two methods PipeWriter uses of a multiprocessing Connection
        def fileno(self) -> int:
            return write_fd

        def close(self) -> None:
            os.close(write_fd)

    return read_fd, PipeWriter(Conn(), **bounds)


def _read_frames(read_fd: int) -> tuple[threading.Thread, list[bytes]]:
    """Start reading frames off the pipe until its end frame; the frames arrive in the returned list."""
    frames: list[bytes] = []

    def read_all() -> None:
        with os.fdopen(read_fd, "rb") as pipe:
            while len(head := pipe.read(FRAME.size)) == FRAME.size:
                (size,) = FRAME.unpack(head)
                if not size:
                    return
                frames.append(pipe.read(size))

    reader = threading.Thread(target=read_all, daemon=True)
    reader.start()
    return reader, frames


def test_pipe_backlog_is_bounded_and_keeps_order() -> None:
    """A reader that stops reading fills the pipe, then the bounded backlog; offers beyond it are
    refused at once (never block); once the reader resumes, every accepted frame arrives whole, in order."""
    read_fd, writer = _pipe_writer(max_buffered=5)
    payload = b"x" * 200_000  # a few frames fill even an enlarged pipe
    accepted = refused = 0
    while refused < 3:
        if writer.put(payload + str(accepted).encode(), 1):
            accepted += 1
        else:
            refused += 1
        assert accepted < 1000, "the backlog bound was never reached"
    assert writer.buffered == 5 and writer.waited == 5  # the five that did not fit in the pipe waited
    reader, frames = _read_frames(read_fd)
    writer.close(timeout_s=30)
    reader.join(30)
    assert not reader.is_alive() and writer.buffered == 0
    values = [pickle.loads(f) for f in frames]
    assert values == [payload + str(i).encode() for i in range(accepted)]


def test_pipe_writes_from_caller_and_drain_thread_keep_order() -> None:
    """A reader that keeps up only part of the time: frames go into the pipe, wait in the backlog, and
    are written out both by the drain thread and by later ``put`` calls; each arrives once, in order."""
    read_fd, writer = _pipe_writer(max_buffered=100_000)

    def frame(i: int) -> bytes:
        return str(i).encode() + b"x" * 50_000

    sent = 0
    while writer.waited < 3:  # nothing reads yet: fill the pipe until frames wait in the backlog
        assert writer.put(frame(sent), 1)
        sent += 1
        assert sent < 1_000, "the pipe never filled"
    reader, frames = _read_frames(read_fd)
    count = sent + 400  # 20 MB more while the reader drains: later puts find frames still waiting
    for i in range(sent, count):
        assert writer.put(frame(i), 1)
    writer.close(timeout_s=30)
    reader.join(30)
    assert not reader.is_alive()
    assert [pickle.loads(f)[:-50_000] for f in frames] == [str(i).encode() for i in range(count)]


def test_pipe_backlog_is_bounded_in_bytes_too() -> None:
    """A stalled producer process: large records are refused once the backlog holds max_buffered_bytes,
    long before the record bound; room comes back as the backlog drains."""
    read_fd, writer = _pipe_writer(max_buffered=1_000, max_buffered_bytes=1 << 20)
    payload = b"x" * 100_000
    accepted = 0
    while writer.put(payload, 1):
        accepted += 1
        assert accepted < 1_000, "the byte bound was never reached"
    assert writer.buffered < 11 and writer.backlog_bytes <= 1 << 20  # ~10 frames of 100 KB wait, not 1,000
    assert writer.backlog_bytes + 100_000 > 1 << 20  # refused because the next frame would not fit
    with os.fdopen(read_fd, "rb") as pipe:
        reader = threading.Thread(target=lambda: [None for _ in iter(lambda: pipe.read(1 << 16), b"")], daemon=True)
        reader.start()
        writer.close(timeout_s=30)
        reader.join(30)
    assert writer.buffered == 0 and writer.backlog_bytes == 0


def test_pipe_to_a_dead_producer_process_counts_records_lost() -> None:
    """The producer process gone (its end of the pipe closed): ``put`` neither raises nor blocks nor keeps
    the frames; each record is counted as lost."""
    read_fd, writer = _pipe_writer(max_buffered=100_000)
    os.close(read_fd)
    for _ in range(5):
        assert writer.put(b"x" * 100_000, 2)
    assert writer.lost == 10 and writer.buffered == 0 and writer.backlog_bytes == 0
    writer.close(timeout_s=30)
    assert not writer.thread.is_alive()


@pytest.mark.parametrize("idle_s", [1.0, 0.0], ids=["polling", "sleeping-in-select"])
def test_producer_process_empties_the_pipe_while_its_work_waits(idle_s: float) -> None:
    """The producer process's reader takes frames off the pipe while nothing consumes them (its main
    thread busy with a slow record), up to its byte bound, so the server's writes find room; then every
    frame comes out whole and in order, whether the reader polls (records flowing) or sleeps (idle)."""
    read_fd, write_fd = os.pipe()
    bound, frame_bytes, count = 1 << 20, 100_000, 80  # 8 MB: more than pipe, read chunk and bound hold
    reader = FrameReader(read_fd, max_bytes=bound, idle_s=idle_s)
    payloads = [bytes([i]) * frame_bytes for i in range(count)]

    def write_all() -> None:
        with os.fdopen(write_fd, "wb") as pipe:
            for payload in payloads:
                pipe.write(FRAME.pack(len(payload)) + payload)
                pipe.flush()
            pipe.write(FRAME.pack(0))

    writer = threading.Thread(target=write_all, daemon=True)
    writer.start()
    with reader.cond:  # nothing consumed yet: the reader still fills its memory up to the bound
        assert reader.cond.wait_for(lambda: reader.pending_bytes >= bound, timeout=30)
    assert reader.pending_bytes < bound + frame_bytes  # and stops there, not reading without end
    assert writer.is_alive()  # so the rest stays in the pipe: the bound holds the writer back
    frames = list(reader)
    writer.join(30)
    assert not writer.is_alive()
    assert frames == payloads
    os.close(read_fd)


def test_decode_roundtrip_of_built_records() -> None:
    (key, value), = _reward_records("k", 1)
    assert key == b"k-0" and decode(value).trajectory_id == "k-0"


def test_a_program_that_never_closes_its_producer_process_still_exits_and_delivers(broker: EmbeddedBroker) -> None:
    """A producer process left open at exit is closed by the program's exit: what was offered is delivered and
    the program ends (without it, multiprocessing's exit handler waits forever on the child, which ignores
    SIGTERM and reads a pipe its parent still holds)."""
    topics = Topics("log-producer-exit")
    create_topics(broker.bootstrap_servers, topics, partitions=1)
    reader = TopicReader(broker.bootstrap_servers, topics.rewards)
    tag = os.urandom(4).hex()
    program = (
        "import sys\n"
        "from streamrl.gateway.recording.log_producer import LogProducer\n"
        "from streamrl.broker.schema import RewardRecord, encode\n"
        "producer = LogProducer(sys.argv[1], process=True)\n"
        "assert producer.wait_ready(60)\n"  # (a child still starting up dies of the SIGTERM: nothing to show)
        "for i in range(5):\n"
        "    rec = RewardRecord(trajectory_id=f'{sys.argv[3]}-{i}', reward=1.0)\n"
        "    assert producer.offer(sys.argv[2], rec.trajectory_id.encode(), encode(rec))\n"
    )
    done = subprocess.run([sys.executable, "-c", program, broker.bootstrap_servers, topics.rewards, tag],
                          timeout=60, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    got = reader.wait_for(lambda r: isinstance(r, RewardRecord) and r.trajectory_id.startswith(tag), count=5)
    assert sorted(r.trajectory_id for r in got) == [f"{tag}-{i}" for i in range(5)]
