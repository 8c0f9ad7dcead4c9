"""Records for the trainer's tests, produced as the gateway produces them, on topics of a test's own; and the
trainer's feed opened on them."""

from __future__ import annotations

import uuid

import numpy as np
from kafka import KafkaConsumer, TopicPartition

from streamrl.broker.schema import CompletionRecord, PolicyRecord, RewardRecord, decode
from streamrl.broker.topics import Topics, create_topics
from streamrl.trainer.config import TrainerConfig
from streamrl.trainer.feed import SKIP_MARGIN_S, StreamGroups
from streamrl.trainer.feed_state import FeedState
from streamrl.trainer.source import KafkaRecordSource
from support.kafka_reader import produce

GROUP_SIZE = 4


def group_records(gid: str, rng: np.random.Generator) -> list:
    """One group: each trajectory makes two calls, the second extending the first (a tool result in
    between), and gets a reward; rewards differ within the group so it carries signal."""
    out: list = []
    for i in range(GROUP_SIZE):
        tid = f"{gid}-t{i}"
        prompt = rng.integers(10, 2000, 12)
        c1 = rng.integers(10, 2000, 8)
        tool = rng.integers(10, 2000, 4)
        c2 = rng.integers(10, 2000, 6)
        for p, c in [(prompt, c1), (np.concatenate([prompt, c1, tool]), c2)]:
            out.append(CompletionRecord(request_id=uuid.uuid4().hex, trajectory_id=tid, group_id=gid,
                                        prompt_token_ids=p, completion_token_ids=c,
                                        logprobs=rng.normal(-7.6, 0.05, len(c)), policy_version=0))
        out.append(RewardRecord(tid, float(i % 2) + 0.1 * i, group_id=gid, group_size=GROUP_SIZE))
    return out


def new_topics(bootstrap: str) -> Topics:
    t = Topics(f"tr{uuid.uuid4().hex[:8]}")
    create_topics(bootstrap, t, partitions=2)
    return t


BOUND = 3


def group(gid: str, *, version: int = 0, rewards: tuple[float, ...] = (1.0, 0.0)) -> list:
    """A group of ``len(rewards)`` one-call trajectories whose rewards differ (so it carries signal)."""
    out: list = []
    for i, r in enumerate(rewards):
        tid = f"{gid}-t{i}"
        out += [CompletionRecord(request_id=uuid.uuid4().hex, trajectory_id=tid, group_id=gid,
                                 prompt_token_ids=[1, 2, 3], completion_token_ids=[4, 5],
                                 logprobs=[-0.5, -0.25], policy_version=version),
                RewardRecord(tid, r, group_id=gid, group_size=len(rewards))]
    return out


def produce_groups(bootstrap: str, topics: Topics, names, **kw) -> None:
    """Every record of the groups ``names`` (``group(name, **kw)``), in order."""
    produce(bootstrap, topics, [r for g in names for r in group(g, **kw)])


def one_partition_topics(bootstrap: str) -> Topics:
    """One partition per topic, so groups become ready in the order they were produced."""
    t = Topics(f"bp{uuid.uuid4().hex[:8]}")
    create_topics(bootstrap, t, partitions=1)
    return t


def open_feed(bootstrap: str, topics: Topics, start: FeedState | None = None,
              skip_margin_s: float = SKIP_MARGIN_S, **cfg) -> StreamGroups:
    """A feed in ``backlog = "wait"`` with fixed one-group steps and a queue bound of ``BOUND``, unless
    ``cfg`` (TrainerConfig fields) says otherwise; the rest as a restart passes it (``StreamGroups``)."""
    cfg = {"backlog": "wait", "groups_per_step": 1, "max_step_tokens": 0, "max_ready_groups": BOUND, **cfg}
    config = TrainerConfig.load(None, model="unused", bootstrap_servers=bootstrap, **cfg)
    return StreamGroups(KafkaRecordSource(bootstrap, topics, f"test-{topics.prefix}", start.offsets if start else None),
                        config, start, skip_margin_s=skip_margin_s)


def policy_records(bootstrap: str, topics: Topics) -> list[PolicyRecord]:
    """Every record on the policy topic: to the end offset, then until an empty poll (tansu under-reports
    multi-record batches)."""
    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None)
    tp = TopicPartition(topics.policy, 0)
    c.assign([tp])
    c.seek_to_beginning(tp)
    end = c.end_offsets([tp])[tp]
    out = []
    while True:
        polled = c.poll(timeout_ms=300)
        for records in polled.values():
            out += [decode(r.value) for r in records]
        if not polled and c.position(tp) >= end:
            break
    c.close()
    return out
