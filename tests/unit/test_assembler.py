"""Completions and rewards -> groups -> Arrow batches: the assembler's rules (timeouts, TTL, duplicates,
staleness, bounded memory) driven by an explicit clock (through the real embedded broker:
``tests/integration/test_assembler_kafka.py``)."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from support.records import call

from streamrl.broker.schema import RewardRecord, decode, encode
from streamrl.trainer.assembler import Assembler, merge_calls, sampling_temperature
from streamrl.trainer.batch import build_batch
from streamrl.trainer.config import TrainerConfig


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


def test_only_the_trainers_policy_is_assembled() -> None:
    """Several policies on one fleet share the topics: a trainer assembles its own policy's trajectories (and
    those served for no policy), skips another's completions with their rewards, in either order, and drops
    a group of the other policy whose reward came first."""
    def served(tid: str, policy: str | None, gid: str = "g") -> object:
        rec = call(tid, [1], [2], gid=gid)
        rec.policy_name = policy
        return rec

    a = asm(policy="support")
    a.add(served("a", "support"), b"", now=0)
    a.add(served("b", None), b"", now=0)                            # the base model by its own name: trained
    a.add(served("x", "sql", gid="h"), b"", now=0)                  # another policy's
    a.add(RewardRecord("x", 1.0, group_id="h"), b"", now=0)         # ... its reward after it
    a.add(RewardRecord("y", 1.0, group_id="h2"), b"", now=0)        # a reward before its completion
    a.add(served("y", "sql", gid="h2"), b"", now=0)
    assert "h2" not in a.groups and "y" not in a.trajectories
    for tid in ("a", "b"):
        a.add(RewardRecord(tid, 1.0, group_id="g"), b"", now=0)
    [g] = a.poll(now=1)
    assert sorted(t.trajectory_id for t in g.trajectories) == ["a", "b"]
    # every record counted once: y's reward as read (rewards) before its completion said whose it was
    assert a.counts["other_policy"] == 3 and a.counts["completions"] == 2 and a.counts["rewards"] == 3
    assert not a.trajectories and not a.groups
    everyone = asm()  # no policy named: every policy's trajectories
    everyone.add(served("x", "sql"), b"", now=0)
    assert "x" in everyone.trajectories and not everyone.counts["other_policy"]


def test_a_reward_naming_another_policy_never_reaches_this_one() -> None:
    """A key limited to policy sql stamps its rewards ``policy = "sql"``: support's trainer skips them even for
    its own trajectories, so its own reward (first of its policy) is the one that counts."""
    a = asm(policy="support", group_size=1)
    rec = call("t", [1], [2], gid="g")
    rec.policy_name = "support"
    a.add(rec, b"", now=0)
    a.add(RewardRecord("t", 1.0, group_id="g", group_size=1, policy="sql"), b"", now=0)
    assert a.poll(now=0) == [] and a.counts["other_policy_reward"] == 1 and a.counts["rewards"] == 0
    a.add(RewardRecord("t", 0.0, group_id="g", group_size=1, policy="support"), b"", now=0)
    [g] = a.poll(now=0)
    assert [t.reward.reward for t in g.trajectories] == [0.0]


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
    assert batch is not None and sorted(batch.column("trajectory_id").to_pylist()) == ["b", "c"]
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
    rows = batch.to_pylist()
    got = {r["trajectory_id"]: r["temperature"] for r in rows}
    assert got == pytest.approx({"a": 0.7, "b": 1.0, "d": 1.3})  # greedy c and invalid e skipped
    assert counts["greedy_trajectories"] == 1 and counts["bad_temperature_trajectories"] == 1
    assert counts["filtered_sampling"] == 1  # d: top_p < 1, its ratios are approximate
    # advantages over the kept three only: rewards 1, 0, 0 -> mean 1/3
    adv = {r["trajectory_id"]: r["advantage"] for r in rows}
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


def test_max_ready_groups_defaults_to_what_could_still_be_trained_in_time() -> None:
    assert TrainerConfig.load(None, model="m", groups_per_step=2, max_lag=4).feed.max_ready_groups == 10
    with pytest.raises(ValueError, match="max_ready_groups"):
        TrainerConfig.load(None, model="m", groups_per_step=4, max_ready_groups=3)


def test_staleness_is_judged_per_sampled_token() -> None:
    """A call the engine moved from version 1 to 6 after 2 of its 4 tokens, trained at 6 with max_lag 2: the
    trajectory stays (its newest tokens are fresh), its first two tokens leave the loss (counted), and the
    batch carries each token's version. A trajectory all of whose tokens are too old is dropped as before."""
    a = asm(group_size=3)
    moved = call("a", [1, 2], [3, 4, 5, 6], version=1)
    moved.version_spans = [(0, 1), (2, 6)]
    for record, r in [(moved, 1.0), (call("b", [1, 2], [7, 8], version=5), 0.0),
                      (call("c", [1, 2], [9], version=1), 1.0)]:
        a.add(record, b"", now=0)
        a.add(RewardRecord(record.trajectory_id, r, group_id="g"), b"", now=0)
    [g] = a.poll(now=0)
    counts: Counter[str] = Counter()
    batch = build_batch(g, current_version=6, max_lag=2, std_norm=True, counts=counts)
    assert batch is not None and batch.column("trajectory_id").to_pylist() == ["a", "b"]
    assert counts["stale_trajectories"] == 1 and counts["stale_tokens"] == 2
    row = batch.to_pylist()[0]
    assert row["token_versions"] == [1, 1, 1, 1, 6, 6] and row["policy_version"] == 1
    assert row["loss_mask"] == [0, 0, 0, 0, 1, 1]  # prompt, the two stale tokens, then the fresh ones
