"""Traffic that does not wait for the trainer (``backlog = "freshest"``, ``max_step_tokens``), through the
real embedded broker: a step grows to take the ready groups up to its token budget, newest first; beyond
``max_ready_groups`` the oldest groups are dropped as overload when they arrive; and a restart from a
checkpoint taken after such drops trains every kept group once and never one that was dropped."""

from __future__ import annotations

import time

import pyarrow as pa
from support.kafka_reader import produce
from support.trainer_records import group, one_partition_topics, produce_groups
from support.trainer_records import open_feed as backpressure_feed

from streamrl.broker.topics import Topics
from streamrl.trainer.batch import Batch
from streamrl.trainer.feed import StreamGroups
from streamrl.trainer.feed_state import FeedState

GROUP_TOKENS = 2 * (3 + 2)
"""Two one-call trajectories of 3 prompt and 2 completion tokens each (``group``)."""


def open_feed(bootstrap: str, topics: Topics, *args, **kw) -> StreamGroups:
    """``support.trainer_records.open_feed`` with ``backlog = "freshest"``."""
    return backpressure_feed(bootstrap, topics, *args, **{"backlog": "freshest", **kw})


def read_everything(s: StreamGroups, groups: int) -> None:
    """Feed every record of ``groups`` produced groups without taking any: asks for more than exist,
    which also lifts the bound for the while (a caller asking for n groups is never starved by it)."""
    deadline = time.monotonic() + 30
    while s.counts["rewards"] < 2 * groups or s.counts["completions"] < 2 * groups:
        assert s.next_batch(1000, 0, 0.5) is None and time.monotonic() < deadline, dict(s.counts)


def ids(batch: pa.RecordBatch | None) -> list[str]:
    return [] if batch is None else Batch.of(batch).group_ids


def test_a_step_grows_with_the_supply_up_to_its_token_budget(broker) -> None:
    bootstrap = broker.bootstrap_servers
    topics = one_partition_topics(bootstrap)
    names = [f"a{i}" for i in range(6)]
    produce_groups(bootstrap, topics, names)
    s = open_feed(bootstrap, topics, max_step_tokens=4 * GROUP_TOKENS, max_ready_groups=10)
    try:
        read_everything(s, len(names))
        # one group asked for, six ready: the step takes the four newest that fit in the budget
        assert ids(s.next_batch(1, 0, 0.5)) == ["a2", "a3", "a4", "a5"]
        assert ids(s.next_batch(1, 0, 0.5)) == ["a0", "a1"]  # at least one, as many as fit
        assert s.next_batch(1, 0, 0.5) is None
        assert s.counts["groups_trained"] == 6 and s.counts["groups_dropped_overload"] == 0
        assert s.counts["tokens_trained"] == s.counts["tokens_generated"] == 6 * 2 * 2
    finally:
        s.close()


def test_fixed_steps_when_the_budget_is_zero(broker) -> None:
    bootstrap = broker.bootstrap_servers
    topics = one_partition_topics(bootstrap)
    produce_groups(bootstrap, topics, ("b0", "b1", "b2"))
    s = open_feed(bootstrap, topics, groups_per_step=2, max_step_tokens=0)
    try:
        read_everything(s, 3)
        assert ids(s.next_batch(2, 0, 0.5)) == ["b1", "b2"]  # exactly two, the newest
        assert s.next_batch(2, 0, 0.5) is None  # one left: not a step's worth
    finally:
        s.close()


def test_overload_drops_the_oldest_and_a_restart_never_trains_them(broker) -> None:
    bootstrap = broker.bootstrap_servers
    topics = one_partition_topics(bootstrap)
    names = [f"c{i}" for i in range(8)]
    produce_groups(bootstrap, topics, names)
    s = open_feed(bootstrap, topics, max_ready_groups=3, max_step_tokens=0)
    try:
        read_everything(s, len(names))  # (asking for more groups than exist: nothing is dropped yet)
        assert ids(s.next_batch(1, 0, 0.5)) == ["c7"]  # newest first...
        assert [g.group_id for g, _ in s.ready] == ["c5", "c6"]  # ...the oldest five beyond the bound dropped
        assert s.counts["groups_dropped_overload"] == 5
        assert not s.paused and not s.records.consumer.paused()  # freshest never pauses reads
        # the checkpoint after that step: offsets past everything read, c5 and c6 held, all eight closed
        saved = s.state()
        assert sum(saved.offsets.values()) == len(names) * 2 * 2 and len(saved.pending) == 2 * 2 * 2
        assert set(names) <= set(saved.done)
    finally:
        s.close()
    produce(bootstrap, topics, group("c0"))  # a duplicate of a dropped group's records, after the restart
    again = open_feed(bootstrap, topics, saved, max_ready_groups=3, max_step_tokens=0)
    try:
        taken = []
        deadline = time.monotonic() + 30
        while again.counts["late"] < 4:  # the duplicate c0's four records: late, never a group again
            taken += ids(again.next_batch(1, 0, 0.5))
            assert time.monotonic() < deadline, dict(again.counts)
        while len(taken) < 2:
            taken += ids(again.next_batch(1, 0, 0.5))
            assert time.monotonic() < deadline, dict(again.counts)
        assert sorted(taken) == ["c5", "c6"]  # the kept groups once each, no dropped one
        assert again.next_batch(1, 0, 1.0) is None and again.counts["groups_dropped_overload"] == 0
    finally:
        again.close()


def test_records_written_before_they_could_be_fresh_are_skipped_unread(broker) -> None:
    """A trainer restarting behind a backlog: with max_lag 1, the checkpoint says version 1 was published
    after the old records were written, so at version 2 they are stale whatever they hold. The feed seeks
    past them instead of reading them, and a restart from the next checkpoint neither reads nor trains them."""
    bootstrap = broker.bootstrap_servers
    topics = one_partition_topics(bootstrap)
    old = [f"s{i}" for i in range(4)]
    produce_groups(bootstrap, topics, old, version=0)
    written = time.time()
    while time.time() < written + 0.3:  # the broker indexes by its own append time: let the clock pass it
        time.sleep(0.05)

    def feed(start: FeedState) -> StreamGroups:
        return open_feed(bootstrap, topics, start, skip_margin_s=0.1,
                         max_lag=1, max_step_tokens=0)

    s = feed(FeedState(published={1: time.time()}))
    try:
        produce(bootstrap, topics, group("fresh", version=1))
        deadline = time.monotonic() + 30
        got: list[str] = []
        while not got:  # version 2: the old groups' 16 records are skipped, the fresh group comes through
            got = ids(s.next_batch(1, 2, 0.5))
            assert time.monotonic() < deadline, dict(s.counts)
        assert got == ["fresh"]
        assert s.counts["records_skipped_stale"] == len(old) * 2 * 2
        assert s.counts["completions"] == s.counts["rewards"] == 2  # the old ones were never read
        assert s.counts["groups_dropped_stale"] == 0 and s.counts["late"] == 0
        saved = s.state()
        assert sum(saved.offsets.values()) == (len(old) + 1) * 2 * 2  # past the skipped records
        assert sorted(saved.published) == [1, 2]  # max_lag + 1 versions, for the checkpoint
    finally:
        s.close()
    again = feed(saved)
    try:
        assert again.next_batch(1, 2, 1.0) is None
        assert again.counts["completions"] == again.counts["rewards"] == 0  # nothing before the offsets
    finally:
        again.close()


def test_a_trainer_can_keep_to_one_tenants_records(broker) -> None:
    """``key_ids``: only records tagged with those API key ids are trained on (the gateway tags each
    completion and reward with the id of the key it came with)."""
    bootstrap = broker.bootstrap_servers
    topics = one_partition_topics(bootstrap)
    records = []
    for name, key_id in (("t0", "team-a"), ("t1", "team-b"), ("t2", None), ("t3", "team-a")):
        for r in group(name):
            r.key_id = key_id
            records.append(r)
    produce(bootstrap, topics, records)
    s = open_feed(bootstrap, topics, max_step_tokens=0, key_ids=("team-a",))
    try:
        deadline = time.monotonic() + 30
        # team-b's and the untagged group: 2 trajectories x (completion + reward) each; team-a's: all held
        while s.counts["not_trained_tenant"] < 8 or s.counts["completions"] < 4 or s.counts["rewards"] < 4:
            assert s.next_batch(1000, 0, 0.5) is None and time.monotonic() < deadline, dict(s.counts)
        assert sorted(ids(s.next_batch(1, 0, 0.5)) + ids(s.next_batch(1, 0, 0.5))) == ["t0", "t3"]
        assert s.counts["groups_trained"] == 2
    finally:
        s.close()
