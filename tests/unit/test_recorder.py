"""The recorder (``gateway/recording/recorder.py``): what the proxy hands it becomes what the log producer builds
records from, every call counted once. The producer is a stand-in that keeps what it is offered (the real one,
with Kafka, is in tests/integration/test_log_producer.py and every gateway test)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from streamrl.engine.wire import deferred_header
from streamrl.gateway.metrics import GatewayMetrics
from streamrl.gateway.recording.capture import CallContext, encode_engine_parts
from streamrl.gateway.recording.recorder import Recorder


class Offers:
    def __init__(self) -> None:
        self.deferred: list[tuple[str, Any, int]] = []
        self.parts: list[tuple[str, Any, tuple[bytes, ...], int, bytes | None]] = []

    def offer_deferred(self, topic: str, build: Any, count: int) -> None:
        self.deferred.append((topic, build, count))

    def offer_parts(self, topic: str, build: Any, parts: tuple[bytes, ...], count: int,
                    wait_for: bytes | None = None) -> None:
        self.parts.append((topic, build, parts, count, wait_for))


class Board:
    """The dashboard's one method the recorder calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, str]] = []

    def served(self, trajectory: str, version: int, name: str) -> None:
        self.calls.append((trajectory, version, name))


def context(**kw: Any) -> CallContext:
    return CallContext(trajectory_id="t1", group_id="g1", endpoint="chat", model="policy", policy_name="policy",
                       policy_version=3, request={}, upstream="http://u", **kw)


def recorder() -> tuple[Recorder, Offers, GatewayMetrics, Board]:
    offers, metrics, board = Offers(), GatewayMetrics(), Board()
    return Recorder(offers, "c", metrics, board), offers, metrics, board  # type: ignore[arg-type]


def test_a_plain_answer_is_built_in_the_producer_and_counted() -> None:
    rec, offers, metrics, board = recorder()
    rec.answer(context(), b'{"choices": []}', choices=2, tokens=(7, 5))
    ((topic, build, count),) = offers.deferred
    assert topic == "c" and count == 2 and callable(build)
    assert (metrics.tokens.prompt, metrics.tokens.completion) == (7, 5) and board.calls == [("t1", 3, "policy")]
    rec.answer(context(), b"{}", choices=0, tokens=(1, 1))  # nothing to record: nothing handed, nothing counted
    assert len(offers.deferred) == 1 and metrics.tokens.prompt == 7


def test_an_engine_answer_without_its_capture_is_handed_on_to_be_counted_invalid() -> None:
    rec, offers, _, _ = recorder()
    rec.engine_answer(context(), b"{}", None)
    ((_, _, count),) = offers.deferred
    assert count == 1 and not offers.parts


def test_deferred_answers_go_at_the_end_of_the_loops_pass_in_order() -> None:
    rec, offers, metrics, _ = recorder()

    async def answer_three() -> int:
        rec.deferred(context(), b"{}", deferred_header("tok-a", (1, 4, 2)))
        rec.deferred(context(), b"{}", deferred_header("tok-b", (2, 6, 3)))
        rec.deferred(context(), b"{}", None)  # names no capture: handed at once, to be counted invalid
        held = len(offers.parts)
        await asyncio.sleep(0)  # the loop's next pass
        return held

    assert asyncio.run(answer_three()) == 0
    assert [(build, count) for _, build, _, count, _ in offers.parts] == [(encode_engine_parts, 1),
                                                                          (encode_engine_parts, 2)]
    assert all(wait is not None for *_, wait in offers.parts) and len(offers.deferred) == 1
    values, total_s = orjson.loads(offers.parts[0][2][0])
    assert "t1" in values and total_s >= 0
    assert (metrics.tokens.prompt, metrics.tokens.completion) == (10, 5)
