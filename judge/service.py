"""The judge service's loop: consume completions and judge requests, judge complete groups, post rewards,
commit offsets.

Exactly once without Kafka transactions (kafka-python has none):

* Each reward goes to the rewards partition its judge request was read from (``partition=``), so it
  always lies after that request in the log, whatever partitioner the producer of the request used.
* Rewards are produced with ``acks=all`` and flushed before a group's records are let go; offsets are
  committed only up to the oldest record still held (``GroupBook.low_watermark``). So after a crash every
  request not fully answered is read again, and so is every reward already posted for it.
* At start the service reads both topics up to their end (as it was at start) before judging anything:
  rewards of its own (``judged_by``) met on the way mark their trajectories done, and those are never
  judged again. Killed at any moment, a restart neither re-posts nor skips a trajectory.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor

from kafka import TopicPartition

from streamrl.broker.clients import make_consumer, make_producer
from streamrl.broker.schema import (
    MAX_TEXT_LENGTH,
    CompletionRecord,
    JudgeRequest,
    RecordError,
    RewardRecord,
    decode,
    encode,
)
from streamrl.broker.topics import Topics

from .client import JudgeClient, Judged, JudgeFailed, Stopped
from .config import JudgeConfig
from .groups import GroupBook, ReadyGroup
from .render import render

log = logging.getLogger(__name__)

LOG_EVERY_S = 30.0
"""How often the counters are logged while they change."""


def mix(score: float, agent: float | None, weight: float) -> float:
    """The group's rule: the judge's score alone, or ``weight * judge + (1 - weight) * agent``."""
    return score if agent is None else weight * score + (1.0 - weight) * agent


class JudgeService:
    def __init__(self, config: JudgeConfig, stop: threading.Event | None = None) -> None:
        self.config = config
        self.stop = stop or threading.Event()
        self.topics = Topics(config.kafka.topic_prefix)
        self.book = GroupBook(config.name, quiet_period_s=config.quiet_period_s, ttl_s=config.trajectory_ttl_s,
                              max_trajectories=config.max_trajectories, settle_s=config.settle_s)
        self.counts: Counter[str] = self.book.counts
        self.client = JudgeClient(config, self.stop)
        self.judged_tokens = 0

    def _connect(self) -> None:
        c = self.config
        self.consumer = make_consumer(c.kafka.bootstrap_servers, group_id=c.consumer_group, security=c.kafka,
                                      client_id="streamrl-judge")
        tps = []
        for topic in (self.topics.completions, self.topics.rewards):
            deadline = time.monotonic() + 30
            while not (parts := self.consumer.partitions_for_topic(topic)):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"topic {topic} has no partitions (does it exist?)")
                time.sleep(0.2)
            tps += [TopicPartition(topic, p) for p in sorted(parts)]
        self.consumer.assign(tps)
        self.next: dict[str, int] = {}
        for tp in tps:
            committed = self.consumer.committed(tp, timeout_ms=5_000)
            if committed is None:
                self.consumer.seek_to_beginning(tp)
            else:
                self.consumer.seek(tp, committed)
            self.next[f"{tp.topic}:{tp.partition}"] = self.consumer.position(tp)
        self.catch_up = {f"{tp.topic}:{tp.partition}": off for tp, off in self.consumer.end_offsets(tps).items()}
        self.committed = dict(self.next)
        log.info("judge %s reading from %s; judging once caught up to %s", c.name, self.next, self.catch_up)
        self.producer = make_producer(c.kafka.bootstrap_servers, security=c.kafka, acks="all", client_id="streamrl-judge")

    def _caught_up(self, polled: int) -> bool:
        if self.catch_up is None:
            return True
        if polled == 0 and all(self.next[k] >= v for k, v in self.catch_up.items()):
            log.info("judge %s caught up: %s", self.config.name, dict(self.counts))
            self.catch_up = None
            return True
        return False

    def _consume(self) -> int:
        n = 0
        now = time.monotonic()
        for tp, records in self.consumer.poll(timeout_ms=int(self.config.poll_timeout_s * 1000)).items():
            key = f"{tp.topic}:{tp.partition}"
            for r in records:
                n += 1
                self.next[key] = r.offset + 1
                try:
                    rec = decode(r.value)
                except RecordError as exc:
                    self.counts[f"bad_{exc.reason}"] += 1
                    continue
                is_completion_topic = tp.topic == self.topics.completions
                if isinstance(rec, CompletionRecord) and is_completion_topic:
                    self.book.add_completion(rec, (key, r.offset), now)
                elif isinstance(rec, JudgeRequest) and not is_completion_topic:
                    self.book.add_request(rec, (key, r.offset), now)
                elif isinstance(rec, RewardRecord) and not is_completion_topic:
                    self.book.add_reward(rec, now)
                else:
                    self.counts["bad_wrong_kind"] += 1
        return n

    def _judge(self, group: ReadyGroup) -> Judged:
        c = self.config
        rubric = group.first.rubric or c.rubric_for(group.group_id)
        rendered = [render(h.calls, c.max_chars_per_trajectory) for h in group.members]
        return self.client.judge(rubric, rendered, group.group_id)

    def _post(self, group: ReadyGroup, judged: Judged) -> None:
        c = self.config
        n = len(group.members)
        weight = c.weight if group.first.weight is None else group.first.weight
        for h, score in zip(group.members, judged.verdict.scores, strict=True):
            req = h.request
            assert req is not None
            normal = score / c.max_score
            metrics = {"judge_score": normal, "judge_weight": weight, "judge_attempts": float(judged.attempts),
                       "judge_prompt_tokens": judged.prompt_tokens / n,
                       "judge_completion_tokens": judged.completion_tokens / n}
            if req.agent_reward is not None:
                metrics["agent_reward"] = req.agent_reward
            record = RewardRecord(h.trajectory_id, mix(normal, req.agent_reward, weight), group_id=req.group_id,
                                  group_size=n + group.already_rewarded, metrics=metrics, key_id=req.key_id,
                                  judged_by=c.name, explanation=judged.verdict.explanation[:MAX_TEXT_LENGTH],
                                  policy=req.policy)
            key, _ = next(o for o in h.offsets if o[0].startswith(self.topics.rewards + ":"))
            self.producer.send(self.topics.rewards, key=h.trajectory_id.encode(), value=encode(record),
                               partition=int(key.rsplit(":", 1)[1]))
        self.producer.flush()
        self.counts["trajectories_judged"] += n
        self.counts["groups_judged"] += 1
        self.judged_tokens += judged.prompt_tokens + judged.completion_tokens

    def _commit(self) -> None:
        mark = self.book.low_watermark(self.next)
        if mark == self.committed:
            return
        from kafka.structs import OffsetAndMetadata

        self.consumer.commit({TopicPartition(k.rsplit(":", 1)[0], int(k.rsplit(":", 1)[1])):
                              OffsetAndMetadata(v, "", -1) for k, v in mark.items()})
        self.committed = mark

    def run(self) -> int:
        self._connect()
        pool = ThreadPoolExecutor(self.config.concurrency, thread_name_prefix="judge")
        running: dict[Future[Judged], ReadyGroup] = {}
        last_commit = last_log = 0.0
        logged: dict[str, int] = {}
        try:
            while not self.stop.is_set():
                polled = self._consume()
                if self._caught_up(polled):
                    for group in self.book.ready(time.monotonic()):
                        running[pool.submit(self._judge, group)] = group
                for fut in [f for f in running if f.done()]:
                    group = running.pop(fut)
                    try:
                        self._post(group, fut.result())
                    except Stopped:
                        continue
                    except JudgeFailed as exc:
                        log.error("judge failure: %s", exc)
                        self.counts["judge_failures"] += 1
                    except Exception:
                        log.exception("judging group %s failed", group.group_id)
                        self.counts["judge_failures"] += 1
                    self.book.finish(group)
                now = time.monotonic()
                if now - last_commit >= self.config.commit_interval_s:
                    self._commit()
                    last_commit = now
                if now - last_log >= LOG_EVERY_S and dict(self.counts) != logged:
                    logged, last_log = dict(self.counts), now
                    log.info("judge %s: %s", self.config.name, logged)
        finally:
            self.stop.set()
            pool.shutdown(wait=True, cancel_futures=True)
            self.producer.flush()
            self.producer.close()
            self.consumer.close(autocommit=False)
            log.info("judge %s stopped: %s", self.config.name, dict(self.counts))
        return 0
