"""Deferred capture (``engine/wire.py``, "Deferred capture") without a server: the wire format, the
engine's outboxes, the producer's join (``gateway/recording/capture_stream.py``), and the frames of ``LogProducer``'s
waiting records."""

from __future__ import annotations

import collections
import time
from typing import Any

import pytest
from support.records import reward_parts

from streamrl.engine.capture_outbox import MAX_QUEUED_BYTES, ORPHAN_AFTER_S, Outbox, _authorised
from streamrl.engine.wire import (
    DEFERRED,
    HEARTBEAT,
    FrameSplitter,
    WireError,
    decode_deferred,
    deferred_frame,
    deferred_header,
    frame,
    parse_deferred_header,
)
from streamrl.gateway.recording.capture_stream import DeferredCaptures, wait_key
from streamrl.gateway.recording.delivery import INVALID, NCOUNTS
from streamrl.gateway.recording.log_producer import (
    Waiting,
    decode_item,
    parts_frame,
)

# -- the wire format ----------------------------------------------------------------------------------------


def test_deferred_frames_and_headers_round_trip() -> None:
    body, capture = b'{"choices": []}', bytes(range(40))
    data = deferred_frame("ab12-7", body, capture) + frame(HEARTBEAT, b"")
    splitter = FrameSplitter(stream=True)
    frames = [f for i in range(0, len(data), 5) for f in splitter.feed(data[i:i + 5])]  # any chunking
    assert [k for k, _ in frames] == [DEFERRED, HEARTBEAT] and splitter.pending == 0
    assert decode_deferred(frames[0][1]) == ("ab12-7", body, capture)
    assert parse_deferred_header(deferred_header("ab12-7", (2, 30, 41))) == ("ab12-7", (2, 30, 41))
    for bad in ("none", "deferred ab12-7 2 30", "deferred ab12-7 2 x 41", "1"):
        assert parse_deferred_header(bad) is None
    with pytest.raises(WireError):
        decode_deferred(frames[0][1][:8])  # cut inside the body
    with pytest.raises(WireError, match="kind"):
        FrameSplitter(stream=True).feed(frame(b"B", b"x"))  # an answer's frame is not a stream's


# -- the engine's outbox ------------------------------------------------------------------------------------


def test_outbox_is_bounded_and_forgets_what_no_reader_took() -> None:
    anomalies: collections.Counter[str] = collections.Counter()
    box = Outbox()
    assert box.put(b"x" * 100, anomalies) and not box.put(b"y" * MAX_QUEUED_BYTES, anomalies)
    assert anomalies["deferred_dropped"] == 1 and box.take() == b"x" * 100 and not box.frames
    box.put(b"a", anomalies)
    box.reader_seen -= ORPHAN_AFTER_S + 1  # its reader went away long ago: the gateway is gone
    assert box.put(b"b", anomalies) and box.take() == b"b" and anomalies["deferred_dropped"] == 2


def test_stream_needs_the_engines_api_key_when_it_has_one() -> None:
    scope = {"headers": [(b"authorization", b"Bearer s3cret")]}
    assert _authorised(scope, ["other", "s3cret"])
    assert not _authorised(scope, ["other"]) and not _authorised({"headers": []}, ["s3cret"])


# -- the producer's join ------------------------------------------------------------------------------------


def _records(context: bytes, body: bytes, capture: bytes) -> list[tuple[bytes | None, bytes]]:
    """A builder of a waiting record: what it was handed, and the side input it waited for."""
    return [(context, body + b"|" + capture)]


class _NoStream:
    def stop(self) -> None:
        pass


def _join(wait_s: float = 30.0) -> tuple[DeferredCaptures, list[Any], list[int]]:
    delivered: list[Any] = []
    counts = [0] * NCOUNTS
    dc = DeferredCaptures(delivered.append, counts, "c1", {}, wait_s)
    dc.readers["http://up"] = _NoStream()  # type: ignore[assignment]  # the join alone: no stream to read
    return dc, delivered, counts


def test_contexts_and_captures_join_in_either_order() -> None:
    dc, delivered, counts = _join()
    try:
        dc.offer(Waiting("t", _records, (b"ctx-1",), 2, wait_key("http://up", "a-1")))
        dc.arrive("http://up", "a-1", b"body-1", b"cap-1")  # the capture second
        dc.arrive("http://up", "a-2", b"body-2", b"cap-2")  # the capture first
        dc.offer(Waiting("t", _records, (b"ctx-2",), 1, wait_key("http://up", "a-2")))
        built = [(topic, count, build()) for topic, _, build, count in delivered]
        assert built == [("t", 2, [(b"ctx-1", b"body-1|cap-1")]), ("t", 1, [(b"ctx-2", b"body-2|cap-2")])]
        assert not dc.waiting and not dc.arrived and counts[INVALID] == 0
    finally:
        dc.close()


def test_a_context_without_its_capture_is_counted_invalid_and_a_lone_capture_forgotten() -> None:
    dc, delivered, counts = _join(wait_s=5.0)
    try:
        dc.offer(Waiting("t", _records, (b"ctx",), 3, wait_key("http://up", "lost-1")))
        dc.arrive("http://up", "orphan-1", b"b", b"c")
        dc.expire(time.monotonic() + 1)  # before the deadline: both still wait
        assert len(dc.waiting) == len(dc.arrived) == 1
        dc.expire(time.monotonic() + 6)
        assert (counts[INVALID], dc.timed_out, dc.orphans, delivered) == (3, 1, 1, [])
    finally:
        dc.close()


# -- LogProducer's waiting records --------------------------------------------------------------------------


def test_waiting_frames_decode_with_their_key() -> None:
    data = b"".join(parts_frame("t.rewards", 0, (b"tag",), 1, wait_for=b"up tok"))
    assert decode_item(data, (reward_parts,)) == Waiting("t.rewards", reward_parts, (b"tag",), 1, b"up tok")


def test_each_upstream_url_has_its_own_outbox_name() -> None:
    """Two URLs reaching one engine (a relay, an alias) must not share an outbox: their streams would take it
    from each other (``test_gateway_upstreams.py``'s relayed upstream is such a pair)."""
    from streamrl.engine.wire import valid_consumer
    from streamrl.gateway.recording.capture_stream import consumer_for

    a, b = consumer_for("0123456789abcdef", "http://127.0.0.1:8000"), consumer_for("0123456789abcdef", "http://h:1")
    assert a != b and valid_consumer(a) and valid_consumer(b)
    assert a == consumer_for("0123456789abcdef", "http://127.0.0.1:8000")


def test_outboxes_of_consumers_long_gone_are_forgotten() -> None:
    from streamrl.engine.capture_outbox import Outboxes

    anomalies: collections.Counter[str] = collections.Counter()
    boxes = Outboxes(anomalies)
    assert boxes.put("read", "t-1", b"b", b"c") and boxes.put("unread", "t-2", b"b", b"c")
    boxes.boxes["read"].take()  # read by its stream, which then went away long ago
    for box in boxes.boxes.values():
        box.reader_seen -= ORPHAN_AFTER_S + 1
    assert boxes.put("new", "t-3", b"b", b"c") and set(boxes.boxes) == {"new"}
    assert anomalies["deferred_dropped"] == 1  # what the gone consumer never read
