"""``Recorder``: the one interface between the proxy and the recording. The proxy relays HTTP; whenever a call it
served has an answer to record, it hands the recorder the call's context and what the upstream sent (vLLM's JSON,
a stream's chunks, or ``streamrl engine``'s body and capture), and the recorder hands the log producer what to
build the records from. Records are built and encoded in the producer, off the event loop; durability (the
buffer, the Kafka producer, the spool) is the producer's. A call is counted here (tokens, the dashboard's served
trajectories) as it is handed over; a missing or malformed capture is handed over too, so that the producer
counts the call as invalid instead of it vanishing.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from streamrl.engine.wire import WireError, capture_counts, parse_deferred_header

from .capture import (
    CallContext,
    StreamCapture,
    encode_call_records,
    encode_engine_parts,
    encode_engine_records,
    engine_parts,
)
from .capture_stream import wait_key
from .log_producer import LogProducer

if TYPE_CHECKING:
    from ..dashboard import Dashboard
    from ..metrics import GatewayMetrics


class Recorder:
    """A served call's answer in, its records out through ``producer`` to ``topic``."""

    def __init__(self, producer: LogProducer, topic: str, metrics: GatewayMetrics,
                 dashboard: Dashboard | None = None) -> None:
        self.producer, self.topic, self.metrics = producer, topic, metrics
        self.dashboard = dashboard
        """Told which version served each recorded call of a policy name (``dashboard.py``)."""
        self._handing_off: list[tuple[CallContext, bytes, str, float]] = []
        """Deferred calls answered in this pass of the event loop, handed to the producer at its end (``flush``)."""

    def answer(self, ctx: CallContext, raw: bytes, choices: int, tokens: tuple[int, int]) -> None:
        """A plain vLLM's non-streamed answer, its ids and logprobs in the JSON (``raw``, as vLLM sent it)."""
        self._offer(ctx, functools.partial(encode_call_records, ctx, raw), choices, tokens)

    def stream(self, ctx: CallContext, capture: StreamCapture) -> None:
        """A plain vLLM's complete stream (and its time to first token)."""
        captures = capture.captures()
        first = min((c.first_token_s for c in captures if c.first_token_s is not None), default=None)
        if first is not None:
            self.metrics.ttft.observe(first - ctx.started)
        tokens = (sum(len(c.prompt_token_ids or ()) for c in captures), sum(len(c.token_ids) for c in captures))
        self._offer(ctx, functools.partial(encode_call_records, ctx, captures), len(captures), tokens)

    def engine_answer(self, ctx: CallContext, body: bytes | list[tuple[float, bytes]], capture: bytes | None) -> None:
        """An answer of ``streamrl engine`` with its capture (``None``: it came without one, counted invalid). A
        non-streamed body and its capture go as they are, beside the context as JSON (``offer_parts``): the event
        loop's cheapest hand-off of the 14 KB a call carries; a stream's events with their arrival times."""
        try:
            count, prompt, completion = capture_counts(capture) if capture is not None else (1, 0, 0)
        except WireError:
            count, prompt, completion = 1, 0, 0
        total_s = self._count(ctx, prompt, completion)
        if isinstance(body, bytes) and capture is not None:
            self.producer.offer_parts(self.topic, encode_engine_parts, (engine_parts(ctx, total_s), body, capture),
                                      max(count, 1))
        else:
            self.producer.offer_deferred(self.topic, functools.partial(encode_engine_records, ctx, body, capture,
                                                                       total_s), max(count, 1))

    def deferred(self, ctx: CallContext, raw: bytes, said: str | None) -> None:
        """An answer whose capture the engine queued on its capture stream (``said``: the answer's capture header,
        naming it): the producer gets only the context and waits there for the capture, so the event loop moves
        vLLM's bytes as with logging off. An answer that names none is counted invalid.

        The hand-off waits for the end of this pass of the event loop (``flush``, one ``call_soon`` for all of
        them), so that the calls a busy loop answers together are handed over one after the other, their code
        and data in the CPU's caches: on the H200 host a hand-off took 5.7 us of CPU so, and 17 us run alone
        between other work (docs/gateway.md, "How it keeps overhead low")."""
        if said is None:
            self.engine_answer(ctx, raw, None)
            return
        if not self._handing_off:
            asyncio.get_running_loop().call_soon(self.flush)
        self._handing_off.append((ctx, raw, said, time.perf_counter() - ctx.started))

    def flush(self) -> None:
        """The deferred calls answered in the loop's last pass, to the producer, in the order answered."""
        calls, self._handing_off = self._handing_off, []
        for ctx, raw, said, total_s in calls:
            named = parse_deferred_header(said)
            if named is None:
                self.engine_answer(ctx, raw, None)
                continue
            token, (count, prompt, completion) = named
            self._count(ctx, prompt, completion)
            self.producer.offer_parts(self.topic, encode_engine_parts, (engine_parts(ctx, total_s),),
                                      max(count, 1), wait_for=wait_key(ctx.upstream, token))

    def _offer(self, ctx: CallContext, build: Callable[[float], list[tuple[bytes | None, bytes]]], count: int,
               tokens: tuple[int, int]) -> None:
        """Hand the call's ``count`` records to the producer: ``build(total_s)`` splits, decodes, builds and
        encodes them there."""
        if count:
            self.producer.offer_deferred(self.topic, functools.partial(build, self._count(ctx, *tokens)), count)

    def _count(self, ctx: CallContext, prompt: int, completion: int) -> float:
        """Count a call handed over (token metrics, the dashboard); its time so far."""
        counts = self.metrics.tokens
        counts.prompt += prompt
        counts.completion += completion
        if self.dashboard is not None and ctx.policy_name is not None and ctx.purpose == "train":
            self.dashboard.served(ctx.trajectory_id, ctx.policy_version, ctx.policy_name)
        return time.perf_counter() - ctx.started
