"""The coordination view's rules (gateway/coordination.py), fed states as the tail process hands them over:
who is live and who leads, judged from the log's order and each reader's own clock, never another host's."""

from __future__ import annotations

import time

from streamrl.broker.schema import GatewayState
from streamrl.broker.topics import Topics
from streamrl.gateway.config import GatewayConfig
from streamrl.gateway.coordination import Coordination

TTL = 5.0


def view(gateway_id: str, joined_offset: int = -1) -> Coordination:
    """A gateway's view with no Kafka behind it (``_apply`` is what the tail process calls); ``joined_offset``:
    this gateway's own first state read back at that offset (-1: not yet)."""
    config = GatewayConfig(upstreams=("http://127.0.0.1:1",), policy_name="policy", gateway_ttl_s=TTL)
    c = Coordination(config, Topics("t"), tails=None, gateway_id=gateway_id)  # type: ignore[arg-type]
    if joined_offset >= 0:
        c.joined_offset, c.ready = joined_offset, True
    return c


def state(gateway_id: str, joined_offset: int = -1, **kw: object) -> GatewayState:
    return GatewayState(gateway_id=gateway_id, policy_name="policy", joined_offset=joined_offset, **kw)


def test_the_gateway_that_joined_first_leads_in_every_view() -> None:
    """One reader saw the fleet's first states, another started later and read only their heartbeats (which
    carry the offsets they joined at, in an order unlike the joins'): both name the same leader."""
    early = view("b", joined_offset=1)
    early._apply([(state("a"), 0), (state("b"), 1), (state("c"), 2)], 2)
    late = view("d", joined_offset=13)
    late._apply([(state("c", 2), 10), (state("b", 1), 11), (state("a", 0), 12), (state("d"), 13)], 13)
    assert early.leader() == late.leader() == "a"
    assert not early.leading and not late.leading
    # the wall-clock times the old protocol ranked by are gone from the record: nothing else to compare
    assert not hasattr(state("a"), "started_at")


def test_liveness_is_the_readers_own_clock_and_a_silent_leader_hands_over() -> None:
    c = view("b", joined_offset=1)
    c._apply([(state("a"), 0), (state("b"), 1)], 1)
    now = time.monotonic()
    assert c.leader(now) == "a"
    assert c.leader(now + TTL + 0.1) == "b", "a, silent for the TTL, is no longer live"
    assert [s.gateway_id for s in c.live(now + TTL + 0.1)] == ["b"], "this gateway always counts as live"
    c._apply([(state("a", 0), 2)], 2)  # a speaks again: live again, and first again
    assert c.leader() == "a"


def test_a_leaving_gateway_and_one_of_another_policy_do_not_lead() -> None:
    c = view("b", joined_offset=2)
    other = GatewayState(gateway_id="x", policy_name="other")
    c._apply([(other, 0), (state("a"), 1), (state("b"), 2)], 2)
    assert c.leader() == "a" and "x" not in c.seen
    c._apply([(state("a", 1, leaving=True), 3)], 3)
    assert c.leading


def test_a_gateway_leads_nothing_before_it_has_joined_and_a_restart_joins_at_the_end() -> None:
    c = view("z")  # its first state not read back yet: ranks last even against a larger id
    c._apply([(state("y", 0), 5)], 5)
    assert c.leader() == "y" and not c.leading
    c = view("b", joined_offset=1)
    c._apply([(state("a"), 0), (state("b"), 1)], 1)
    c._apply([(state("a"), 4)], 4)  # a restarted under the same id: a first state again
    assert c.seen["a"].joined == 4 and c.leading
