"""Backpressure in the trainer's feed (``backlog = "wait"``), through the real embedded broker: a full ready queue pauses reads
from Kafka (kafka-python ``pause``) instead of dropping groups, reads resume once it drains, offsets stay
exact across pauses and restarts, and a pause does not run the assembler's group timeouts."""

from __future__ import annotations

import time

from support.kafka_reader import produce
from support.trainer_records import BOUND, group, one_partition_topics, open_feed, produce_groups

from streamrl.trainer.batch import Batch
from streamrl.trainer.feed import StreamGroups


def take(s: StreamGroups, version: int = 0, timeout: float = 30.0) -> str:
    """The id of the next group handed out, checking after every call that reads are paused exactly
    while the ready queue is full and that the consumer's positions are the feed's offsets."""
    deadline = time.monotonic() + timeout
    while True:
        got = s.next_batch(1, version, 0.5)
        check_pause_state(s)
        if got is not None:
            [gid] = Batch.of(got).group_ids
            return gid
        assert time.monotonic() < deadline, f"no group within {timeout}s; counts {dict(s.counts)}"


def check_pause_state(s: StreamGroups) -> None:
    consumer = s.records.consumer
    full = len(s.ready) >= BOUND
    assert s.paused == full, (len(s.ready), s.paused)
    assert consumer.paused() == (consumer.assignment() if full else set()), (len(s.ready), consumer.paused())
    positions = {f"{tp.topic}:{tp.partition}": consumer.position(tp) for tp in consumer.assignment()}
    assert positions == s.state().offsets


def take_until_paused(s: StreamGroups, taken: list[str]) -> None:
    deadline = time.monotonic() + 30
    while not s.paused:
        taken.append(take(s))
        assert time.monotonic() < deadline, f"reads never paused; counts {dict(s.counts)}"


def test_full_ready_queue_pauses_reads_and_drops_nothing(broker) -> None:
    bootstrap = broker.bootstrap_servers
    topics = one_partition_topics(bootstrap)
    first, second = [f"g{i:02d}" for i in range(6)], [f"g{i:02d}" for i in range(6, 12)]
    produce_groups(bootstrap, topics, first)
    s = open_feed(bootstrap, topics)
    taken: list[str] = []
    try:
        take_until_paused(s, taken)  # six groups read, the queue holds >= BOUND of them: reads paused
        assert s.counts["reads_paused"] >= 1 and s.records.consumer.paused()
        read = (s.counts["completions"], s.counts["rewards"])
        produce_groups(bootstrap, topics, second)  # in the log while reads are paused
        while s.paused:  # drain the queue: nothing new is read until it is below the bound
            taken.append(take(s))
            assert (s.counts["completions"], s.counts["rewards"]) == read
        assert not s.records.consumer.paused()  # resumed once the queue held fewer than BOUND
        while len(taken) < len(first + second):
            taken.append(take(s))
        assert taken == first + second  # every group exactly once, in log order
        assert s.next_batch(1, 0, 1.0) is None and not s.ready
        assert s.counts["groups_ready"] == 12 and s.counts["groups_dropped_overflow"] == 0
        assert s.counts["groups_dropped_stale"] == 0 and s.counts["incomplete_dropped"] == 0
        assert s.counts["reads_paused"] >= 1 and s.counts["reads_paused_s"] > 0
        assert s.counts["completions"] == s.counts["rewards"] == 24
        assert not s.paused and not s.records.consumer.paused()
    finally:
        s.close()


def test_restart_from_a_checkpoint_taken_while_paused_is_exact(broker) -> None:
    # as the daemon checkpoints after a step: offsets, the records held but not trained, the trained ids
    bootstrap = broker.bootstrap_servers
    topics = one_partition_topics(bootstrap)
    groups = [f"r{i:02d}" for i in range(10)]
    produce_groups(bootstrap, topics, groups[:6])
    s = open_feed(bootstrap, topics)
    taken: list[str] = []
    try:
        take_until_paused(s, taken)
        produce_groups(bootstrap, topics, groups[6:])  # unread while paused
        taken.append(take(s))
        assert s.paused  # still full, so the checkpoint below is taken with reads paused
        saved = s.state()
        offsets = saved.offsets
        # offsets cover exactly what was read (all of it fed), none of what was produced while paused
        assert sum(offsets.values()) == s.counts["completions"] + s.counts["rewards"] <= 6 * 2 * 2
    finally:
        s.close()
    again = open_feed(bootstrap, topics, saved)
    try:
        while len(taken) < len(groups):
            taken.append(take(again))
        assert taken == groups  # none twice, none skipped, in order
        assert again.next_batch(1, 0, 1.0) is None
        assert again.counts["late"] == 0 and again.counts["groups_dropped_overflow"] == 0
        assert sum(again.state().offsets.values()) == len(groups) * 2 * 2
    finally:
        again.close()


def test_stale_groups_in_a_full_queue_are_dropped_and_reads_resume(broker) -> None:
    bootstrap = broker.bootstrap_servers
    topics = one_partition_topics(bootstrap)
    old = [f"o{i}" for i in range(5)]
    produce_groups(bootstrap, topics, old, version=0)
    s = open_feed(bootstrap, topics, max_lag=1)
    taken: list[str] = []
    try:
        take_until_paused(s, taken)
        produce_groups(bootstrap, topics, ("n0", "n1"), version=5)
        # trained version 5 now: every queued group (served by version 0) is stale, the queue empties,
        # reads resume and the fresh groups come through
        assert [take(s, version=5), take(s, version=5)] == ["n0", "n1"]
        assert s.counts["groups_dropped_stale"] == len(old) - len(taken)  # every old group not taken
        assert s.counts["groups_dropped_overflow"] == 0
        assert not s.paused and not s.records.consumer.paused()
    finally:
        s.close()


def test_time_paused_does_not_run_group_timeouts(broker) -> None:
    # a group half read when reads pause: its last reward waits in the log. Paused for longer than the
    # group timeout, it must still be completed from the log after the resume, not cut short.
    bootstrap = broker.bootstrap_servers
    topics = one_partition_topics(bootstrap)
    full = [f"f{i}" for i in range(5)]
    half = group("h")
    produce(bootstrap, topics, [r for g in full for r in group(g)] + half[:3])  # h: both calls, one reward
    s = open_feed(bootstrap, topics, group_timeout_s=3.0)
    taken: list[str] = []
    try:
        take_until_paused(s, taken)
        assert s.counts["rewards"] == 2 * len(full) + 1  # h's first reward was read before the pause
        time.sleep(4.0)  # the stimulus: longer than group_timeout_s, all of it paused
        produce(bootstrap, topics, half[3:])
        while "h" not in taken:
            taken.append(take(s))
        assert taken == [*full, "h"]
        assert s.counts["incomplete_trained"] == 0 and s.counts["incomplete_dropped"] == 0
        assert s.counts["late"] == 0 and s.counts["groups_ready"] == len(full) + 1
        assert s.counts["reads_paused_s"] >= 4.0
    finally:
        s.close()


def test_backpressure_counters_are_served_on_metrics() -> None:
    from collections import Counter

    from prometheus_client import generate_latest

    from streamrl.trainer.metrics import Metrics

    m = Metrics(port=0)
    step = {"version": 1, "step": 1, "reward_mean": 0.5, "reward_std": 0.1, "groups": 1, "tokens": 10,
            "tokens_per_s": 1.0, "staleness_mean": 0.0, "staleness_max": 0, "loss": 0.1, "ratio_mean": 1.0,
            "truncated_frac": 0.0, "kl_behaviour": 0.0, "grad_norm": 1.0}
    m.report(step, Counter(groups_ready=3, reads_paused=1, reads_paused_s=1.25))
    m.report(step, Counter(groups_ready=4, reads_paused=2, reads_paused_s=2.5))
    text = generate_latest(m.registry).decode()
    assert "streamrl_trainer_reads_paused_total 2.0" in text
    assert "streamrl_trainer_reads_paused_seconds_total 2.5" in text
    assert 'streamrl_trainer_records_total{outcome="groups_ready"} 4.0' in text
    assert "reads_paused" not in "".join(line for line in text.splitlines() if "records_total" in line)
    m.count(Counter(groups_ready=9, groups_no_signal=5, reads_paused=2, reads_paused_s=2.5))  # between steps
    text = generate_latest(m.registry).decode()
    assert 'streamrl_trainer_records_total{outcome="groups_ready"} 9.0' in text
    assert 'streamrl_trainer_records_total{outcome="groups_no_signal"} 5.0' in text
