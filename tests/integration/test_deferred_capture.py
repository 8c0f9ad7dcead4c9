"""Deferred capture (``engine/wire.py``, "Deferred capture") against real servers: the engine's
outboxes and stream on the real vLLM CPU server, and the waiting records of ``LogProducer`` in a process and a
thread (the wire format, the outbox and the producer's join on their own: ``tests/unit/test_deferred_wire.py``).
The records' contents through the whole path are checked by ``test_engine_capture.py``, whose gateway runs
both deferred and framed."""

from __future__ import annotations

import functools
import os
import threading
import time
from typing import Any

import httpx
import pytest
from support.kafka_reader import TopicReader
from support.records import reward_parts

from streamrl.broker.embedded import EmbeddedBroker
from streamrl.broker.schema import RewardRecord
from streamrl.broker.topics import Topics, create_topics
from streamrl.engine.server import Engine
from streamrl.engine.wire import (
    CAPTURE_HEADER,
    DEFERRED,
    PROBE_PATH,
    STREAM_PATH,
    FrameSplitter,
    capture_counts,
    decode_capture,
    decode_deferred,
    parse_deferred_header,
)
from streamrl.gateway.recording.delivery import INVALID
from streamrl.gateway.recording.log_producer import (
    LogProducer,
    WaiterSpec,
    Waiting,
)

# -- the engine's outbox ------------------------------------------------------------------------------------


def _stream_frames(engine: Engine, consumer: str, until: int, timeout_s: float = 30) -> list[tuple[bytes, bytes]]:
    """The first ``until`` ``D`` frames of the consumer's stream (heartbeats skipped)."""
    got: list[tuple[bytes, bytes]] = []
    splitter = FrameSplitter(stream=True)
    with httpx.stream("GET", f"{engine.url}{STREAM_PATH}", params={"consumer": consumer}, timeout=timeout_s) as r:
        assert r.status_code == 200
        for chunk in r.iter_raw():
            got += [f for f in splitter.feed(chunk) if f[0] == DEFERRED]
            if len(got) >= until:
                return got
    raise AssertionError(f"the stream ended after {len(got)} frames")


def test_engine_answers_plain_and_queues_the_capture_for_its_consumer(engine: Engine, base_model: str) -> None:
    """The real vLLM server: a ``defer=`` request's answer is vLLM's own body (unframed) naming a token; the
    consumer's stream (opened after the answer: the outbox kept it) carries that token, the same body and a
    capture whose counts are the header's; a request that is streamed is framed instead."""
    assert httpx.get(f"{engine.url}{PROBE_PATH}").json()["deferred"] is True
    consumer = f"test-{os.urandom(4).hex()}"
    body = {"model": base_model, "prompt": "one, two", "max_tokens": 12, "n": 2, "seed": 5}
    r = httpx.post(f"{engine.url}/v1/completions", json=body, headers={CAPTURE_HEADER: f"defer={consumer}"},
                   timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 2  # plain JSON: not framed
    token, counts = parse_deferred_header(r.headers[CAPTURE_HEADER])
    [(_, payload)] = _stream_frames(engine, consumer, until=1)
    got_token, got_body, capture = decode_deferred(payload)
    assert (got_token, got_body) == (token, r.content)
    assert capture_counts(capture) == counts and counts[0] == 2
    tokens = decode_capture(capture)
    assert sum(len(t.token_ids) for t in tokens) == r.json()["usage"]["completion_tokens"] == counts[2]
    streamed = httpx.post(f"{engine.url}/v1/completions", json=body | {"stream": True},
                          headers={CAPTURE_HEADER: f"defer={consumer}"}, timeout=60)
    assert streamed.headers[CAPTURE_HEADER] == "1"  # framed: its capture comes in the answer
    bad = httpx.get(f"{engine.url}{STREAM_PATH}", params={"consumer": "no spaces"}, timeout=10)
    assert bad.status_code == 400


def test_a_newer_stream_of_the_same_consumer_replaces_the_older(engine: Engine) -> None:
    consumer = f"test-{os.urandom(4).hex()}"
    ended = threading.Event()

    def first() -> None:
        with httpx.stream("GET", f"{engine.url}{STREAM_PATH}", params={"consumer": consumer}, timeout=30) as r:
            for _ in r.iter_raw():
                pass
        ended.set()

    t = threading.Thread(target=first, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while httpx.get(f"{engine.url}{PROBE_PATH}").json()["outboxes"]["readers"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with httpx.stream("GET", f"{engine.url}{STREAM_PATH}", params={"consumer": consumer}, timeout=30) as r:
        next(r.iter_raw())  # the second is connected and sent its first bytes (a heartbeat)
        assert ended.wait(10)


# -- LogProducer's waiting records --------------------------------------------------------------------------


class _Instant:
    """A waiter whose side input is there at once: ``side`` for every key but ``never``."""

    def __init__(self, deliver: Any, counts: Any, side: bytes) -> None:
        self.deliver, self.counts, self.side = deliver, counts, side

    def offer(self, w: Waiting) -> None:
        if w.key == b"never":
            self.counts[INVALID] += w.count
        else:
            self.deliver((w.topic, None, functools.partial(w.build, *w.parts, self.side), w.count))

    def close(self) -> None:
        pass


def instant_waiter(deliver: Any, counts: Any, side: bytes) -> _Instant:
    return _Instant(deliver, counts, side)


@pytest.mark.parametrize("process", [True, False], ids=["process", "thread"])
def test_records_waiting_for_a_side_input_are_built_by_the_waiter(broker: EmbeddedBroker, process: bool) -> None:
    topics = Topics("log-producer-waiting")
    create_topics(broker.bootstrap_servers, topics, partitions=1)
    reader = TopicReader(broker.bootstrap_servers, topics.rewards)
    tag = os.urandom(4).hex()
    spec = WaiterSpec(instant_waiter, (b"xyz",))
    producer = LogProducer(broker.bootstrap_servers, process=process, waiter=spec, builders=(reward_parts,))
    try:
        for i in range(5):
            assert producer.offer_parts(topics.rewards, reward_parts, (f"{tag}-{i}".encode(),), 1, wait_for=b"k")
        assert producer.offer_parts(topics.rewards, reward_parts, (b"lost",), 2, wait_for=b"never")
    finally:
        producer.close()
    assert (producer.stats.delivered, producer.stats.invalid) == (5, 2)
    got = reader.wait_for(lambda r: isinstance(r, RewardRecord) and r.trajectory_id.startswith(tag), count=5)
    assert sorted(r.reward for r in got) == [3.0] * 5  # built with the waiter's side input


