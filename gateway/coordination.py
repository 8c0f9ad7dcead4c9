"""The coordination log of the gateways in front of the same replicas: their states, and who leads.

Every gateway of one policy name writes its ``GatewayState`` to the one-partition topic
``<prefix>.gateways`` every ``heartbeat_s`` and reads everyone's, so every gateway sees the same states
in the same order. No clock of one host is compared with another's:

* Live: a gateway is live while this gateway received a state of it within the last ``gateway_ttl_s``
  (its own monotonic clock) and that state is not marked ``leaving``.
* Leader: the live gateway that joined the log first. A gateway's first state joins it (that record's
  offset); once read back, every later state carries the offset as ``joined_offset``, so every reader,
  however late it started reading, ranks the gateways alike, no election round. A gateway restarted
  under the same id joins again, at the end.

A gateway that starts reads the recent log at once, so a gateway that died just before looks live to it
for up to ``gateway_ttl_s``; having joined last, it does not lead while any other looks live, so at worst
the fleet's newest member waits that long before leading a fleet of one. What the states mean (who
loads, who routes what, when a version may be unloaded) is ``hotswap.py``'s business; this module only
keeps the log and the view.

A starting gateway reads the topic from ``now - 2 x gateway_ttl_s`` (``offsets_for_times``; a broker
that answers an earlier offset only makes it read more): every live gateway has written a whole state
since then, and older states are of gateways that are dead anyway. It then writes its own state and
reads on until that state comes back, so that its view holds every gateway that wrote before it
before it decides whether it leads.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from streamrl.broker.schema import GatewayState, RecordError, decode, encode
from streamrl.broker.topics import Topics, create_gateways_topic
from streamrl.gateway.tail_process import KafkaUnavailable, Records, Tail, TailProcess

from .config import GatewayConfig

log = logging.getLogger(__name__)


def default_gateway_id(started_at: float) -> str:
    """Host, process and start time: unique per gateway process, a restarted one included."""
    return f"{socket.gethostname()}-{os.getpid()}-{int(started_at * 1000)}"


@dataclass(frozen=True, slots=True)
class Seen:
    """A gateway's latest state, the offset it was read at, the offset the gateway joined at (the rank of
    leadership) and when this gateway received it (``time.monotonic()``; liveness)."""

    state: GatewayState
    offset: int
    joined: int
    received: float


class Coordination:
    """Reads and writes ``<prefix>.gateways`` through the gateway's ``TailProcess``. ``on_change`` callbacks run
    on the event loop after each batch of states read; ``applied_offset`` is the last offset whose state the
    callbacks have seen."""

    def __init__(self, config: GatewayConfig, topics: Topics, tails: TailProcess, gateway_id: str,
                 policy_name: str | None = None) -> None:
        self.config, self.topics, self.topic, self.tails = config, topics, topics.gateways, tails
        self.gateway_id = gateway_id
        self.policy_name = config.policy_name if policy_name is None else policy_name
        """The policy whose gateways this view holds (a gateway serving several keeps one view per policy)."""
        self.joined_offset = -1
        """The offset of this gateway's first state, once read back (``ready``)."""
        self.seen: dict[str, Seen] = {}
        """The latest state of each gateway of this policy name, this one's included."""
        self.applied_offset = -1
        self.malformed = 0
        self.ready = False
        """The view is whole (this gateway's first state read back); before, it leads nothing."""
        self.on_change: list[Callable[[], None]] = []
        self._own_offset = -1
        self._own_back = asyncio.Event()

    # -- life cycle ----------------------------------------------------------------------------------
    async def start(self, first: GatewayState) -> None:
        """Read the recent log, write ``first``, and return once it has been read back (the view is whole).
        Kafka unreachable: retried every second, for as long as it takes (the caller serves meanwhile)."""
        while True:
            try:
                await asyncio.to_thread(create_gateways_topic, self.config.kafka.bootstrap_servers, self.topics,
                                        security=self.config.kafka)
                break
            except Exception as exc:
                log.warning("coordination cannot reach Kafka (%s); retrying", exc)
                await asyncio.sleep(1.0)
        self.tails.subscribe(Tail(self.topic, since_s=time.time() - 2 * self.config.gateway_ttl_s), self._read)
        while True:
            try:
                offset = await self.write(first)
                break
            except (KafkaUnavailable, TimeoutError) as exc:
                log.warning("coordination cannot write its state yet (%s); retrying", exc)
                await asyncio.sleep(1.0)
        if self.applied_offset >= offset:  # read back before the ack came
            self._own_back.set()
        await self._own_back.wait()
        self.joined_offset = offset
        self.ready = True

    async def stop(self, last: GatewayState | None) -> None:
        """Write ``last`` (a ``leaving`` state, so nobody waits out the TTL for this gateway)."""
        if last is not None:
            try:
                await self.write(last, timeout_s=5.0)
            except Exception as exc:
                log.warning("could not write the leaving state: %s", exc)

    async def write(self, state: GatewayState, timeout_s: float = 30.0) -> int:
        """Send ``state`` (stamped with this gateway's ``joined_offset``) and wait for its ack; returns its offset."""
        state.joined_offset = self.joined_offset
        offset = await self.tails.write(self.topic, self.gateway_id.encode(), encode(state), timeout_s)
        self._own_offset = max(self._own_offset, offset)
        return offset

    # -- the view ------------------------------------------------------------------------------------
    def _live(self, now: float) -> list[Seen]:
        return [s for s in self.seen.values()
                if s.state.gateway_id == self.gateway_id
                or (not s.state.leaving and now - s.received <= self.config.gateway_ttl_s)]

    def live(self, now: float | None = None) -> list[GatewayState]:
        """The live gateways' latest states (this one always counts as live); ``now``: ``time.monotonic()``."""
        return [s.state for s in self._live(time.monotonic() if now is None else now)]

    def leader(self, now: float | None = None) -> str:
        """The live gateway that joined first (ties, which one log cannot hold: the smaller id). This one
        ranks last until it has joined."""
        own = self.joined_offset if self.ready else math.inf
        ranks = [(s.joined, s.state.gateway_id) for s in self._live(time.monotonic() if now is None else now)
                 if s.state.gateway_id != self.gateway_id]
        return min([*ranks, (own, self.gateway_id)])[1]

    @property
    def leading(self) -> bool:
        return self.ready and self.leader() == self.gateway_id

    def state_of(self, gateway_id: str) -> Seen | None:
        return self.seen.get(gateway_id)

    def view(self) -> dict[str, object]:
        """For ``/health``: who this is, who leads, who is live."""
        now = time.monotonic()
        return {"gateway_id": self.gateway_id, "leader": self.leader(now),
                "live": sorted(s.gateway_id for s in self.live(now)), "malformed_states": self.malformed}

    # -- the log, read by the tail process -----------------------------------------------------------
    def _read(self, records: Records) -> None:
        states = []
        for offset, value in records:
            try:
                record = decode(value)
            except RecordError as exc:
                self.malformed += 1
                log.error("skipping bad gateway state at offset %d: %s", offset, exc)
                continue
            if isinstance(record, GatewayState):
                states.append((record, offset))
        self._apply(states, records[-1][0])

    def _apply(self, states: list[tuple[GatewayState, int]], last: int) -> None:
        received = time.monotonic()
        for state, offset in states:
            if state.policy_name == self.policy_name:
                # a first state (joined_offset -1) joins at its own offset; a restart under the same id joins anew
                joined = state.joined_offset if state.joined_offset >= 0 else offset
                self.seen[state.gateway_id] = Seen(state, offset, joined, received)
        self.applied_offset = max(self.applied_offset, last)
        if self._own_offset >= 0 and self.applied_offset >= self._own_offset:
            self._own_back.set()
        for callback in self.on_change:
            callback()
