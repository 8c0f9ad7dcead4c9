"""The assembler through the real embedded broker: completions and rewards produced exactly as the gateway
does (shared schema + a Kafka producer keyed by trajectory id) become the expected groups and Arrow batches."""

from __future__ import annotations

import math
import time
import uuid

import numpy as np
import pyarrow as pa
import pytest
from support.kafka_reader import produce
from support.records import call

from streamrl.broker.schema import PolicyRecord, RewardRecord, encode
from streamrl.broker.topics import Topics, create_topics
from streamrl.trainer.batch import BATCH_SCHEMA
from streamrl.trainer.config import TrainerConfig
from streamrl.trainer.feed import StreamGroups
from streamrl.trainer.source import KafkaRecordSource


def fresh_topics(bootstrap: str) -> Topics:
    t = Topics(f"asm{uuid.uuid4().hex[:8]}")
    create_topics(bootstrap, t, partitions=2)
    return t


def stream(bootstrap: str, topics: Topics, **cfg) -> StreamGroups:
    config = TrainerConfig.load(None, model="unused", bootstrap_servers=bootstrap, **cfg)
    return StreamGroups(KafkaRecordSource(bootstrap, topics, f"test-{topics.prefix}"), config)


def await_batch(s: StreamGroups, n: int, timeout: float = 30.0, version: int = 0) -> pa.RecordBatch:
    """The next step's batch of ``n`` groups."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = s.next_batch(n, version, 0.5)
        if got is not None:
            return got
    raise AssertionError(f"no {n} groups within {timeout}s; counts {dict(s.counts)}")


def test_records_through_kafka_become_the_expected_batch(broker) -> None:
    topics = fresh_topics(broker.bootstrap_servers)
    recs = [
        # rewards first for two of them: they must wait for their completions
        RewardRecord("A", 1.0, group_id="g1", group_size=3),
        RewardRecord("B", 0.0, group_id="g1", group_size=3),
        call("A", [10, 11], [12, 13], gid="g1"),
        call("A", [10, 11, 12, 13, 14], [15], gid="g1"),      # multi-turn: merged into one sequence
        call("B", [10, 11], [20], gid="g1"),
        call("B", [30], [31, 32], gid="g1"),                  # a fresh context: a second sequence
        call("C", [10, 11], [40, 41, 42], gid="g1"),
        RewardRecord("C", 2.0, group_id="g1", group_size=3),
    ]
    produce(broker.bootstrap_servers, topics, recs)
    s = stream(broker.bootstrap_servers, topics)
    try:
        table = await_batch(s, 1)
    finally:
        s.close()
    assert table.schema.equals(BATCH_SCHEMA)
    rows = sorted(table.to_pylist(), key=lambda r: (r["trajectory_id"], r["token_ids"]))
    assert [(r["trajectory_id"], r["token_ids"], r["loss_mask"]) for r in rows] == [
        ("A", [10, 11, 12, 13, 14, 15], [0, 0, 1, 1, 0, 1]),
        ("B", [10, 11, 20], [0, 0, 1]),
        ("B", [30, 31, 32], [0, 1, 1]),
        ("C", [10, 11, 40, 41, 42], [0, 0, 1, 1, 1]),
    ]
    assert rows[0]["behaviour_logprobs"] == pytest.approx([0, 0, -0.1, -0.2, 0, -0.1])
    # rewards 1, 0, 2: mean 1, population std sqrt(2/3)
    std = math.sqrt(2 / 3)
    adv = {r["trajectory_id"]: r["advantage"] for r in rows}
    assert adv == pytest.approx({"A": 0.0, "B": -1 / std, "C": 1 / std}, rel=1e-5)
    assert {r["group_id"] for r in rows} == {"g1"} and s.counts["groups_ready"] == 1


def test_bad_records_are_counted_and_skipped(broker) -> None:
    topics = fresh_topics(broker.bootstrap_servers)
    good = encode(call("X", [1, 2], [3, 4], gid="gb"))
    nan = call("Y", [1], [2, 3], gid="gb")
    nan.logprobs = np.array([-0.1, np.nan], np.float32)
    bad_version = bytearray(good)
    bad_version[4] = 99
    raw = [
        (topics.completions, b"not a record"),                  # malformed
        (topics.completions, bytes(bad_version)),               # unknown schema version
        (topics.completions, encode(nan)),                      # NaN logprob
        (topics.completions, good[:-4]),                        # token / logprob lengths differ
        (topics.rewards, encode(RewardRecord("X", float("inf"), group_id="gb"))),  # non-finite reward
        (topics.completions, encode(PolicyRecord("p", 1, "/x", "m", 1, "0" * 64))),  # wrong kind
    ]
    good_records = [call("X", [1, 2], [3, 4], gid="gb"), call("Z", [1, 2], [5], gid="gb"),
                    RewardRecord("X", 1.0, group_id="gb", group_size=2), RewardRecord("Z", 0.0, group_id="gb")]
    produce(broker.bootstrap_servers, topics, good_records, raw)
    s = stream(broker.bootstrap_servers, topics)
    try:
        batch = await_batch(s, 1)  # the good records still make their group
    finally:
        s.close()
    assert batch.num_rows == 2
    assert {k: v for k, v in s.counts.items() if k.startswith("bad_")} == {
        "bad_malformed": 1, "bad_unknown_version": 1, "bad_nan_logprob": 1, "bad_length_mismatch": 1,
        "bad_non_finite_reward": 1, "bad_wrong_kind": 1}


def test_staleness_is_judged_again_when_taken(broker) -> None:
    # four groups ready at once on one partition (so in log order): g0, g1 served by version 0, g2, g3
    # by version 2. Taken at version 2 with max_lag 1: g0 and g1 (lag 2) must be dropped then, though
    # they were fresh when they became ready; g2 is trained, g3 stays queued. (Queue bound 3: nothing is
    # dropped for being over it, see tests/integration/test_trainer_backpressure.py.)
    bootstrap = broker.bootstrap_servers
    topics = Topics(f"asm{uuid.uuid4().hex[:8]}")
    create_topics(bootstrap, topics, partitions=1)
    recs = []
    for i, version in enumerate([0, 0, 2, 2]):
        for t, r in [("a", 1.0), ("b", 0.0)]:
            recs += [call(f"g{i}{t}", [1], [2], gid=f"g{i}", version=version),
                     RewardRecord(f"g{i}{t}", r, group_id=f"g{i}", group_size=2)]
    produce(bootstrap, topics, recs)
    config = TrainerConfig.load(None, model="unused", bootstrap_servers=bootstrap, groups_per_step=1, max_lag=1,
                           max_ready_groups=3, backlog="wait", max_step_tokens=0)  # oldest first, one per step
    s = StreamGroups(KafkaRecordSource(bootstrap, topics, f"test-{topics.prefix}"), config)
    try:
        deadline = time.monotonic() + 30
        while s.counts["rewards"] < 8 or s.counts["completions"] < 8:  # everything consumed, nothing taken
            assert s.next_batch(100, 0, 0.5) is None and time.monotonic() < deadline, dict(s.counts)
        assert s.counts["groups_ready"] == 4
        assert [g.group_id for g, _ in s.ready] == ["g0", "g1", "g2", "g3"]
        batch = s.next_batch(1, 2, 0.5)
        assert batch is not None and batch.column("group_id").to_pylist() == ["g2", "g2"]
        assert max(2 - v for v in batch.column("policy_version").to_pylist()) <= 1
        assert s.counts["stale_trajectories"] == 4 and s.counts["groups_dropped_stale"] == 2
        # the checkpoint holds only g3's records; every group is closed (dropped ones too)
        saved = s.state()
        assert len(saved.pending) == 4
        assert {"g0", "g1", "g2", "g3"} <= set(saved.done)
    finally:
        s.close()
    # restart from that state: g3 comes back, the dropped g0 and g1 are neither retrained nor lost again
    again = StreamGroups(KafkaRecordSource(bootstrap, topics, f"test-{topics.prefix}", saved.offsets), config, saved)
    try:
        batch = again.next_batch(1, 2, 5.0)
        assert batch is not None and batch.column("group_id").to_pylist() == ["g3", "g3"]
        assert again.next_batch(1, 2, 1.0) is None
        assert again.counts["late"] == 0 and again.counts["groups_ready"] == 1
    finally:
        again.close()
