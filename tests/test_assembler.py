"""Completions and rewards -> groups -> Arrow batches: records produced exactly as the gateway does
(shared schema + a Kafka producer keyed by trajectory id) through the real embedded broker, and the
assembler's rules (timeouts, TTL, duplicates, staleness, bounded memory) driven by an explicit clock."""

from __future__ import annotations

import math
import time
import uuid
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from kafka_reader import produce

from streamrl.broker.schema import CompletionRecord, PolicyRecord, RewardRecord, decode, encode
from streamrl.broker.topics import Topics, create_topics
from streamrl.trainer.assembler import Assembler, merge_calls, sampling_temperature
from streamrl.trainer.batch import BATCH_SCHEMA, build_batch, load_batches, save_batch
from streamrl.trainer.config import TrainerConfig
from streamrl.trainer.feed import StreamGroups
from streamrl.trainer.source import KafkaRecordSource


def call(tid: str, prompt: list[int], completion: list[int], *, gid: str | None = "g", version: int = 0,
         req: str | None = None, request: dict | None = None) -> CompletionRecord:
    lp = -np.arange(1, len(completion) + 1, dtype=np.float32) / 10
    return CompletionRecord(request_id=req or uuid.uuid4().hex, trajectory_id=tid, group_id=gid,
                            prompt_token_ids=np.array(prompt), completion_token_ids=np.array(completion),
                            logprobs=lp, policy_version=version, request=request or {})



def fresh_topics(bootstrap: str) -> Topics:
    t = Topics(f"asm{uuid.uuid4().hex[:8]}")
    create_topics(bootstrap, t, partitions=2)
    return t


def stream(bootstrap: str, topics: Topics, **cfg) -> StreamGroups:
    config = TrainerConfig(model="unused", bootstrap_servers=bootstrap, **cfg)
    return StreamGroups(KafkaRecordSource(bootstrap, topics, f"test-{topics.prefix}"), config)


def await_groups(s: StreamGroups, n: int, timeout: float = 30.0, version: int = 0) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = s.next_groups(n, version, 0.5)
        if got:
            return got
    raise AssertionError(f"no {n} groups within {timeout}s; counts {dict(s.counts)}")


def test_merge_calls_extends_and_splits() -> None:
    a = call("t", [1, 2, 3], [4, 5])
    b = call("t", [1, 2, 3, 4, 5, 9, 9], [6], version=2)      # extends a: tool result 9 9, then 6
    c = call("t", [1, 2, 7], [8])                              # does not extend: new sequence
    seqs = merge_calls([a, b, c])
    assert [s.token_ids.tolist() for s in seqs] == [[1, 2, 3, 4, 5, 9, 9, 6], [1, 2, 7, 8]]
    assert seqs[0].loss_mask.tolist() == [0, 0, 0, 1, 1, 0, 0, 1]
    np.testing.assert_allclose(seqs[0].behaviour_logprobs, [0, 0, 0, -0.1, -0.2, 0, 0, -0.1], rtol=1e-6)
    assert seqs[0].policy_version == 0 and seqs[0].request_ids == [a.request_id, b.request_id]


def test_merge_calls_does_not_depend_on_log_order() -> None:
    """One trajectory's calls through two gateways reach the log in either order (each gateway has its own
    producer): the merge is the same for every order, and a call continues the longest sequence it extends."""
    import itertools

    a = call("t", [1, 2, 3], [4, 5])
    b = call("t", [1, 2, 3, 4, 5, 9], [6])                     # continues a
    c = call("t", [1, 2, 7], [8])                              # another context
    d = call("t", [1, 2, 3, 4, 5, 9, 6, 9], [10])              # continues a + b
    e = call("t", [1, 2, 7, 8, 11], [12])                      # continues c
    want = [[1, 2, 3, 4, 5, 9, 6, 9, 10], [1, 2, 7, 8, 11, 12]]
    for order in itertools.permutations([a, b, c, d, e]):
        seqs = merge_calls(list(order))
        assert sorted(s.token_ids.tolist() for s in seqs) == sorted(want), order
        by_len = {len(s.token_ids): s for s in seqs}
        assert by_len[9].request_ids == [a.request_id, b.request_id, d.request_id]
        assert by_len[9].loss_mask.tolist() == [0, 0, 0, 1, 1, 0, 1, 0, 1]


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
        [batch] = await_groups(s, 1)
    finally:
        s.close()
    table = batch.to_arrow()
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
        [batch] = await_groups(s, 1)  # the good records still make their group
    finally:
        s.close()
    assert len(batch.sequences) == 2
    assert {k: v for k, v in s.counts.items() if k.startswith("bad_")} == {
        "bad_malformed": 1, "bad_unknown_version": 1, "bad_nan_logprob": 1, "bad_length_mismatch": 1,
        "bad_non_finite_reward": 1, "bad_wrong_kind": 1}


def asm(**kw) -> Assembler:
    return Assembler(**{"group_size": 2, "group_timeout_s": 10.0, "ttl_s": 100.0, "max_trajectories": 100, **kw})


def test_group_ready_at_size_and_first_duplicate_reward_wins() -> None:
    a = asm()
    a.add(call("a", [1], [2]), b"", now=0)
    a.add(RewardRecord("a", 1.0, group_id="g"), b"", now=0)
    a.add(RewardRecord("a", 5.0, group_id="g"), b"", now=0)       # duplicate: ignored
    a.add(call("b", [1], [3], req="r1"), b"", now=0)
    a.add(call("b", [1], [3], req="r1"), b"", now=0)              # duplicate completion: ignored
    assert a.poll(now=1) == []
    a.add(RewardRecord("b", 0.0, group_id="g"), b"", now=1)
    [g] = a.poll(now=1)
    assert g.complete and sorted(t.reward.reward for t in g.trajectories) == [0.0, 1.0]
    assert len(next(t for t in g.trajectories if t.trajectory_id == "b").completions) == 1
    a.add(RewardRecord("a", 3.0, group_id="g"), b"", now=2)        # group already trained: late
    assert a.counts["duplicate_reward"] == 1 and a.counts["duplicate_completion"] == 1 and a.counts["late"] == 1
    assert not a.trajectories and not a.groups


def test_timeout_trains_partial_group_or_drops_it() -> None:
    a = asm(group_size=4)
    for t, r in [("a", 1.0), ("b", 0.0)]:
        a.add(call(t, [1], [2], gid="big"), b"", now=0)
        a.add(RewardRecord(t, r, group_id="big"), b"", now=0)
    a.add(RewardRecord("c", 1.0, group_id="small"), b"", now=0)
    a.add(call("c", [1], [2], gid="small"), b"", now=0)
    assert a.poll(now=9.9) == []
    [g] = a.poll(now=10.0)
    assert g.group_id == "big" and not g.complete and len(g.trajectories) == 2
    assert a.counts["incomplete_trained"] == 1 and a.counts["incomplete_dropped"] == 1


def test_ttl_expiry_and_eviction_bound_memory() -> None:
    a = asm(ttl_s=5.0, max_trajectories=3)
    a.add(call("lonely", [1], [2]), b"", now=0)                           # never rewarded
    a.add(RewardRecord("orphan", 1.0, group_id="o", group_size=1), b"", now=0)  # never completed
    a.poll(now=4)
    assert set(a.trajectories) == {"lonely", "orphan"}
    a.poll(now=5)
    assert "lonely" not in a.trajectories and a.counts["expired_completions"] == 1
    for i in range(4):
        a.add(call(f"t{i}", [1], [2]), b"", now=6)
    assert len(a.trajectories) == 3 and a.counts["evicted"] >= 1


def test_stale_and_signal_free_groups_are_skipped_and_counted() -> None:
    a = asm(group_size=3)
    for t, r, v in [("a", 1.0, 0), ("b", 0.0, 5), ("c", 1.0, 5)]:
        a.add(call(t, [1], [2], version=v), b"", now=0)
        a.add(RewardRecord(t, r, group_id="g"), b"", now=0)
    [g] = a.poll(now=0)
    counts: Counter[str] = Counter()
    batch = build_batch(g, current_version=6, max_lag=2, std_norm=True, counts=counts)
    assert batch is not None and sorted(s.trajectory_id for s in batch.sequences) == ["b", "c"]
    assert counts["stale_trajectories"] == 1
    assert build_batch(g, current_version=9, max_lag=2, std_norm=True, counts=counts) is None
    assert counts["groups_dropped_stale"] == 1
    for t in ("x", "y"):
        a.add(call(t, [1], [2], gid="flat"), b"", now=0)
        a.add(RewardRecord(t, 0.5, group_id="flat", group_size=2), b"", now=0)
    [flat] = a.poll(now=0)
    assert build_batch(flat, current_version=0, max_lag=2, std_norm=True, counts=counts) is None
    assert counts["groups_no_signal"] == 1


def test_sampling_temperature_from_the_logged_request_goes_into_the_batch() -> None:
    # the gateway logs the request body (record.request); vLLM's default temperature is 1.0
    rec = decode(encode(call("t", [1], [2], request={"model": "m", "temperature": 0.7, "max_tokens": 4})))
    assert sampling_temperature(rec) == pytest.approx(0.7)
    assert sampling_temperature(call("t", [1], [2])) == 1.0
    assert math.isnan(sampling_temperature(call("t", [1], [2], request={"temperature": "hot"})))
    a = asm(group_size=5)
    specs = [("a", 1.0, {"temperature": 0.7}), ("b", 0.0, {}), ("c", 1.0, {"temperature": 0}),
             ("d", 0.0, {"temperature": 1.3, "top_p": 0.9}), ("e", 1.0, {"temperature": -1})]
    for t, r, req in specs:
        a.add(call(t, [1], [2], request=req), b"", now=0)
        a.add(RewardRecord(t, r, group_id="g"), b"", now=0)
    [g] = a.poll(now=0)
    counts: Counter[str] = Counter()
    batch = build_batch(g, current_version=0, max_lag=2, std_norm=False, counts=counts)
    assert batch is not None
    got = {s.trajectory_id: s.temperature for s in batch.sequences}
    assert got == pytest.approx({"a": 0.7, "b": 1.0, "d": 1.3})  # greedy c and invalid e skipped
    assert counts["greedy_trajectories"] == 1 and counts["bad_temperature_trajectories"] == 1
    assert counts["filtered_sampling"] == 1  # d: top_p < 1, its ratios are approximate
    # advantages over the kept three only: rewards 1, 0, 0 -> mean 1/3
    adv = {s.trajectory_id: s.advantage for s in batch.sequences}
    assert adv == pytest.approx({"a": 2 / 3, "b": -1 / 3, "d": -1 / 3})


def test_a_change_of_temperature_starts_a_new_sequence() -> None:
    a = call("t", [1, 2], [3], request={"temperature": 0.5})
    b = call("t", [1, 2, 3, 4], [5], request={"temperature": 0.5})  # extends a
    c = call("t", [1, 2, 3, 4, 5, 6], [7])                           # would extend, but sampled at 1.0
    seqs = merge_calls([a, b, c])
    assert [(s.token_ids.tolist(), s.temperature) for s in seqs] == [([1, 2, 3, 4, 5], 0.5),
                                                                     ([1, 2, 3, 4, 5, 6, 7], 1.0)]


def test_all_greedy_group_is_dropped_and_counted() -> None:
    a = asm(group_size=2)
    for t, r in [("a", 1.0), ("b", 0.0)]:
        a.add(call(t, [1], [2], request={"temperature": 0.0}), b"", now=0)
        a.add(RewardRecord(t, r, group_id="g"), b"", now=0)
    [g] = a.poll(now=0)
    counts: Counter[str] = Counter()
    assert build_batch(g, current_version=0, max_lag=2, std_norm=True, counts=counts) is None
    assert counts["greedy_trajectories"] == 2 and counts["groups_dropped_unusable"] == 1


def two_trajectory_batch():
    """One group of two one-call trajectories with rewards 1 and 0, as its batch."""
    a = asm()
    for t, r in [("a", 1.0), ("b", 0.0)]:
        a.add(call(t, [1, 2], [3, 4]), b"", now=0)
        a.add(RewardRecord(t, r, group_id="g"), b"", now=0)
    [g] = a.poll(now=0)
    return build_batch(g, current_version=0, max_lag=2, std_norm=False, counts=Counter())


def test_version_1_batch_files_load_at_temperature_one(tmp_path) -> None:
    batch = two_trajectory_batch()
    old = pa.Table.from_batches([batch.to_arrow()]).drop_columns(["temperature"])
    pq.write_table(old, tmp_path / "00000001-000.parquet")
    [back] = load_batches(tmp_path)
    assert [s.temperature for s in back.sequences] == [1.0, 1.0]
    assert back.to_arrow().drop_columns(["temperature"]).equals(batch.to_arrow().drop_columns(["temperature"]))


def test_parquet_round_trip(tmp_path) -> None:
    batch = two_trajectory_batch()
    save_batch(batch, tmp_path, "00000001-000")
    [back] = load_batches(tmp_path)
    assert back.to_arrow().equals(batch.to_arrow()) and back.group_id == batch.group_id == "g"
    s = back.sequences[0]  # numpy arrays of the loss's types, as the live path hands them over
    assert (s.token_ids.dtype, s.loss_mask.dtype, s.behaviour_logprobs.dtype) == (np.int32, np.int8, np.float32)


def test_staleness_is_judged_again_when_taken(broker) -> None:
    # four groups ready at once on one partition (so in log order): g0, g1 served by version 0, g2, g3
    # by version 2. Taken at version 2 with max_lag 1: g0 and g1 (lag 2) must be dropped then, though
    # they were fresh when they became ready; g2 is trained, g3 stays queued. (Queue bound 3: nothing is
    # dropped for being over it, see tests/test_trainer_backpressure.py.)
    bootstrap = broker.bootstrap_servers
    topics = Topics(f"asm{uuid.uuid4().hex[:8]}")
    create_topics(bootstrap, topics, partitions=1)
    recs = []
    for i, version in enumerate([0, 0, 2, 2]):
        for t, r in [("a", 1.0), ("b", 0.0)]:
            recs += [call(f"g{i}{t}", [1], [2], gid=f"g{i}", version=version),
                     RewardRecord(f"g{i}{t}", r, group_id=f"g{i}", group_size=2)]
    produce(bootstrap, topics, recs)
    config = TrainerConfig(model="unused", bootstrap_servers=bootstrap, groups_per_step=1, max_lag=1,
                           max_ready_groups=3, backlog="wait", max_step_tokens=0)  # oldest first, one per step
    s = StreamGroups(KafkaRecordSource(bootstrap, topics, f"test-{topics.prefix}"), config)
    try:
        deadline = time.monotonic() + 30
        while s.counts["rewards"] < 8 or s.counts["completions"] < 8:  # everything consumed, nothing taken
            assert s.next_groups(100, 0, 0.5) == [] and time.monotonic() < deadline, dict(s.counts)
        assert s.counts["groups_ready"] == 4
        assert [g.group_id for g, _ in s.ready] == ["g0", "g1", "g2", "g3"]
        [batch] = s.next_groups(1, 2, 0.5)
        assert [s.group_id for s in batch.sequences] == ["g2", "g2"]
        assert max(2 - s.policy_version for s in batch.sequences) <= 1
        assert s.counts["stale_trajectories"] == 4 and s.counts["groups_dropped_stale"] == 2
        # the checkpoint holds only g3's records; every group is closed (dropped ones too)
        pending = s.pending_raw()
        assert len(pending) == 4
        assert {"g0", "g1", "g2", "g3"} <= set(s.done_ids())
        offsets, done = s.offsets(), s.done_ids()
    finally:
        s.close()
    # restart from that state: g3 comes back, the dropped g0 and g1 are neither retrained nor lost again
    again = StreamGroups(KafkaRecordSource(bootstrap, topics, f"test-{topics.prefix}", offsets), config,
                         restore=pending, done=done)
    try:
        [batch] = again.next_groups(1, 2, 5.0)
        assert [s.group_id for s in batch.sequences] == ["g3", "g3"]
        assert again.next_groups(1, 2, 1.0) == []
        assert again.counts["late"] == 0 and again.counts["groups_ready"] == 1
    finally:
        again.close()


def test_max_ready_groups_defaults_to_what_could_still_be_trained_in_time() -> None:
    assert TrainerConfig(model="m", groups_per_step=2, max_lag=4).max_ready_groups == 10
    with pytest.raises(ValueError, match="max_ready_groups"):
        TrainerConfig(model="m", groups_per_step=4, max_ready_groups=3)
