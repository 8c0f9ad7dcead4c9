"""The log as a dataset: what a range of the completions and rewards topics holds, joined into one row per
trajectory, written to Parquet or JSONL (``streamrl export``; the command is ``export_cli.py``, the output's
schema is documented in docs/export.md and is ``SCHEMA`` here).

The range. ``LogRange.snapshot`` fixes, before anything is read, the end offsets of every partition of
both topics, so an export never chases a live log: what is produced after it started is not in it. The
start is each partition's beginning, or with ``since`` the offset Kafka's time index gives for it; with
``until`` the end is cut where the time index says records get later. Records inside the offsets are
also filtered by their own Kafka timestamp (``outside_time_range``), since the index is coarse.

The join, and why memory stays bounded. Records are processed in event time: the partitions of both
topics are merged by Kafka timestamp (a k-way merge over a bounded buffer per partition), so a reward
meets its completions in about the order they happened, whatever the read order of two topics. A
trajectory is held (its completions) from its first completion until it closes:

* a reward closes it ``reward_grace_s`` of event time after the reward (completions logged a little
  after their reward, e.g. through another gateway, still join), and its row is written then;
* without a reward it expires ``open_ttl_s`` of event time after its last completion, counted
  ``unrewarded`` (and written with a null reward with ``unrewarded=True``);
* beyond ``max_open`` open trajectories, the one longest without a completion is closed early
  (``evicted``).

So memory holds the trajectories active within ``open_ttl_s`` of event time (at most ``max_open``), one
fetch buffer per partition and one row group of output, never the whole topic. At the end of the range
every open trajectory is closed as above: rewarded ones are written, unrewarded ones counted (and
written with ``unrewarded=True``), rewards that met no completion counted ``reward_without_completions``.

The join rules are the trainer's (``trainer/assembler.py``), restated here without importing it: group
id from the reward, else the first call's, else the trajectory id; the first reward of a trajectory
wins (``duplicate_reward``); a call seen twice (request id and choice index) counts once
(``duplicate_completion``); only calls of the chosen purpose are exported (default ``train``, what the
trainer trains on; ``purpose_<p>`` counts the others). Records that cannot be decoded are counted by
``RecordError.reason`` and skipped; nothing in the log makes an export fail.
"""

from __future__ import annotations

import heapq
import logging
import os
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
from kafka import KafkaConsumer, TopicPartition
from kafka.consumer.fetcher import ConsumerRecord
from tqdm import tqdm

from .clients import POLL_ALL, make_consumer
from .schema import PURPOSES, CompletionRecord, JudgeRequest, RecordError, RewardRecord, decode
from .security import KafkaSettings
from .topics import Topics

log = logging.getLogger(__name__)

FORMATS = ("parquet", "jsonl")

CALL = pa.struct([
    ("request_id", pa.string()), ("choice_index", pa.int32()), ("purpose", pa.string()),
    ("group_id", pa.string()), ("key_id", pa.string()), ("model", pa.string()), ("endpoint", pa.string()),
    ("upstream", pa.string()), ("policy_name", pa.string()), ("policy_version", pa.int32()),
    ("version_spans", pa.list_(pa.list_(pa.int32(), 2))),
    ("prompt_token_ids", pa.list_(pa.int32())), ("completion_token_ids", pa.list_(pa.int32())),
    ("logprobs", pa.list_(pa.float32())), ("response_text", pa.string()), ("finish_reason", pa.string()),
    ("request_json", pa.string()), ("tool_calls_json", pa.string()), ("usage_json", pa.string()),
    ("created", pa.float64()), ("ttft_s", pa.float64()), ("total_s", pa.float64()),
    ("log_partition", pa.int32()), ("log_offset", pa.int64()), ("log_timestamp_ms", pa.int64()),
])
"""One call (one sampled choice): every ``CompletionRecord`` field, free-form dicts as JSON text (their
keys differ call to call), plus where the record sits in the log."""

SCHEMA = pa.schema([
    ("trajectory_id", pa.string()), ("group_id", pa.string()), ("group_size", pa.int32()),
    ("reward", pa.float64()), ("reward_metrics", pa.list_(pa.struct([("name", pa.string()), ("value", pa.float64())]))),
    ("judged_by", pa.string()), ("explanation", pa.string()), ("reward_key_id", pa.string()),
    ("reward_created", pa.float64()), ("key_id", pa.string()), ("policy", pa.string()),
    ("policy_versions", pa.list_(pa.int32())),
    ("n_calls", pa.int32()), ("calls", pa.list_(CALL)),
])
"""One row per trajectory. Metrics are a list of (name, value) rather than an Arrow map: the map type
does not survive every reader (``datasets`` among them), and JSONL keeps the same shape."""


def parse_time(text: str) -> int:
    """Epoch milliseconds of ``text``: epoch seconds (``1764000000.5``) or an ISO 8601 time (UTC when it
    names no zone)."""
    try:
        return round(float(text) * 1000)
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(text)
    except ValueError as exc:
        raise ValueError(f"not an ISO time or epoch seconds: {text!r}") from exc
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return round(when.timestamp() * 1000)


@dataclass(frozen=True, slots=True)
class ExportOptions:
    """What to export and how. ``export_cli.py`` makes one flag per field."""

    out: Path = Path("export.parquet")
    """The output file (written as OUT.partial, renamed when complete)."""
    format: Literal["parquet", "jsonl"] | None = None
    """Output format (default: from the output's suffix, .parquet or .jsonl)."""
    kafka: KafkaSettings = field(default_factory=KafkaSettings)
    """The Kafka read from: brokers, topic prefix (PREFIX.completions, PREFIX.rewards), security."""
    since_ms: int | None = None
    """Only records at or after this Kafka timestamp (epoch ms)."""
    until_ms: int | None = None
    """Only records at or before this Kafka timestamp (epoch ms)."""
    purpose: Literal["train", "eval", "judge", "all"] = "train"
    """Only calls of this purpose (train: what the trainer trains on; all: every call)."""
    min_reward: float | None = None
    """Only rewarded trajectories whose reward is at least this (e.g. SFT on the best)."""
    policy: str | None = None
    """Only this policy's trajectories (several policies on one fleet): calls served for another policy are
    counted ``other_policy`` and their trajectories' rewards with them, as are rewards naming another policy
    (``other_policy_reward``); calls served for no policy (a base model by its own name) are kept, as the
    trainer keeps them."""
    unrewarded: bool = False
    """Also write trajectories without a reward in the range (reward null); counted either way."""
    reward_grace_s: float = 60.0
    """Event time a trajectory stays open after its reward, for calls logged a little after it."""
    open_ttl_s: float = 600.0
    """Event time after its last call that a trajectory without a reward is closed (the trainer's
    trajectory_ttl_s default)."""
    max_open: int = 100_000
    """At most this many trajectories held at once (the memory bound); the one longest idle is closed first."""
    row_group_rows: int = 1024
    """Rows per Parquet row group (and per JSONL write)."""
    progress: bool = True
    """Show a progress bar (records read of the range's total) on a terminal."""

    def resolved_format(self) -> str:
        if self.format is not None:
            return self.format
        suffix = self.out.suffix.lower().lstrip(".")
        if suffix not in FORMATS:
            raise ValueError(f"cannot tell the format from {self.out.name!r}: name it .parquet or .jsonl, "
                             f"or give --format")
        return suffix

    def __post_init__(self) -> None:
        if self.purpose not in (*PURPOSES, "all"):
            raise ValueError(f"purpose must be one of {', '.join((*PURPOSES, 'all'))}, not {self.purpose!r}")
        if self.since_ms is not None and self.until_ms is not None and self.since_ms > self.until_ms:
            raise ValueError("since is after until")
        if self.max_open < 1 or self.row_group_rows < 1:
            raise ValueError("max_open and row_group_rows must be at least 1")


@dataclass(frozen=True)
class LogRange:
    """The offsets an export reads: ``[start, end)`` of each partition (keys ``(topic, partition)``)."""

    start: dict[tuple[str, int], int]
    end: dict[tuple[str, int], int]

    @property
    def total(self) -> int:
        return sum(max(0, self.end[k] - self.start[k]) for k in self.end)

    @classmethod
    def snapshot(cls, options: ExportOptions, consumer: KafkaConsumer | None = None) -> LogRange:
        """The range as the log stands now (taken before reading: an export never goes past it)."""
        own = consumer is None
        consumer = consumer or _consumer(options)
        try:
            return cls._snapshot(consumer, options)
        finally:
            if own:
                consumer.close()

    @classmethod
    def _snapshot(cls, consumer: KafkaConsumer, options: ExportOptions) -> LogRange:
        topics = Topics(options.kafka.topic_prefix)
        tps = [TopicPartition(t, p) for t in (topics.completions, topics.rewards) for p in _partitions(consumer, t)]
        begin = consumer.beginning_offsets(tps)
        end = _true_ends(consumer, tps, consumer.end_offsets(tps))
        start = dict(begin)
        if options.since_ms is not None:
            for tp, at in _lookup(consumer, tps, options.since_ms, end).items():
                start[tp] = max(begin[tp], at)
        if options.until_ms is not None:
            for tp, at in _lookup(consumer, tps, options.until_ms + 1, end).items():
                end[tp] = min(end[tp], at)
        key = lambda tp: (tp.topic, tp.partition)  # noqa: E731
        return cls({key(tp): min(start[tp], end[tp]) for tp in tps}, {key(tp): end[tp] for tp in tps})


def _lookup(consumer: KafkaConsumer, tps: list[TopicPartition], ms: int,
            end: dict[TopicPartition, int]) -> dict[TopicPartition, int]:
    """The first offset at or after ``ms`` of each partition whose answer can be trusted (a partition left
    out is read whole, its records filtered by timestamp). Kafka's time index answers exactly, and "none"
    means the end; an answer is trusted when the record there has the timestamp the broker said: the
    embedded broker (tansu) answers offset 0 with the partition's newest timestamp, whatever the time."""
    found = {}
    for tp, at in consumer.offsets_for_times({tp: ms for tp in tps}).items():
        if at is None:
            found[tp] = end[tp]
        elif at.timestamp >= ms and _timestamp_at(consumer, tp, at.offset, end[tp]) == at.timestamp:
            found[tp] = at.offset
    return found


def _timestamp_at(consumer: KafkaConsumer, tp: TopicPartition, offset: int, end: int,
                  timeout_s: float = 10.0) -> int | None:
    """The timestamp of the first record at or after ``offset`` (None: none before ``end``)."""
    if offset >= end:
        return None
    consumer.assign([tp])
    consumer.seek(tp, offset)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            records = consumer.poll(timeout_ms=200, max_records=1).get(tp)
            if records:
                return records[0].timestamp
        return None
    finally:
        consumer.unsubscribe()


def _consumer(options: ExportOptions) -> KafkaConsumer:
    return make_consumer(options.kafka.bootstrap_servers, group_id=None, security=options.kafka, client_id="streamrl-export",
                         max_partition_fetch_bytes=FETCH_BYTES)


def _partitions(consumer: KafkaConsumer, topic: str, timeout_s: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while not (parts := consumer.partitions_for_topic(topic)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"topic {topic} not found (wrong --topic-prefix or --bootstrap-servers?)")
        time.sleep(0.2)
    return sorted(parts)


def _true_ends(consumer: KafkaConsumer, tps: list[TopicPartition], listed: dict[TopicPartition, int],
               timeout_s: float = 10.0) -> dict[TopicPartition, int]:
    """The end offsets: ListOffsets' answer, raised to the high watermark of one fetch of each partition's
    last record. The embedded broker (tansu) answers ListOffsets with the last batch's base offset + 1, so
    the rest of that batch would be missed; Kafka's answer equals the high watermark."""
    ends = dict(listed)
    probe = [tp for tp in tps if listed[tp] > 0]
    if not probe:
        return ends
    consumer.assign(probe)
    for tp in probe:
        consumer.seek(tp, listed[tp] - 1)
    deadline = time.monotonic() + timeout_s
    while (missing := [tp for tp in probe if consumer.highwater(tp) is None]) and time.monotonic() < deadline:
        consumer.poll(timeout_ms=200)
    for tp in probe:
        ends[tp] = max(ends[tp], consumer.highwater(tp) or 0)
    if missing:
        log.warning("no high watermark for %s: their listed end offsets are used", missing)
    consumer.unsubscribe()
    return ends


@dataclass
class ExportSummary:
    """What an export did. ``counts``: every record and trajectory outcome by reason (skips included)."""

    out: str
    format: str
    rows: int = 0
    records: int = 0
    """Records read in the range."""
    unrewarded: int = 0
    """Trajectories with calls but no reward in the range (written only with ``unrewarded``)."""
    bytes: int = 0
    peak_open: int = 0
    """The most trajectories held at once."""
    counts: Counter[str] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        return {"out": self.out, "format": self.format, "rows": self.rows, "records": self.records,
                "unrewarded": self.unrewarded, "bytes": self.bytes, "peak_open": self.peak_open,
                "counts": dict(sorted(self.counts.items()))}


@dataclass(slots=True)
class _Call:
    record: CompletionRecord
    partition: int
    offset: int
    timestamp_ms: int


@dataclass(slots=True)
class _Trajectory:
    trajectory_id: str
    last_ms: int
    calls: list[_Call] = field(default_factory=list)
    seen: set[tuple[str, int]] = field(default_factory=set)
    reward: RewardRecord | None = None


def export(options: ExportOptions, log_range: LogRange | None = None) -> ExportSummary:
    """Export ``log_range`` (default: a snapshot taken now) to ``options.out``; returns the summary."""
    fmt = options.resolved_format()
    consumer = _consumer(options)
    partial = options.out.with_name(options.out.name + ".partial")
    try:
        log_range = log_range or LogRange.snapshot(options, consumer)
        summary = ExportSummary(str(options.out), fmt)
        sink = _ParquetSink(partial) if fmt == "parquet" else _JsonlSink(partial)
        try:
            joiner = _Joiner(options, summary, sink, Topics(options.kafka.topic_prefix))
            with tqdm(total=log_range.total, unit="rec", desc="export", disable=not options.progress or None,
                      leave=False) as bar:
                for record in _merged(consumer, log_range, summary.counts):
                    summary.records += 1
                    bar.update()
                    joiner.add(record)
            joiner.finish()
        finally:
            sink.close()
        os.replace(partial, options.out)
        summary.bytes = options.out.stat().st_size
        return summary
    finally:
        consumer.close()
        partial.unlink(missing_ok=True)


BUFFER_RECORDS = 4096
"""Records buffered per partition before its fetching is paused (the merge's memory: this, plus at most
one fetch, ``FETCH_BYTES``, per partition)."""
FETCH_BYTES = 16 << 20
"""The most one fetch brings of one partition (kafka-python's ``max_partition_fetch_bytes``)."""


def _merged(consumer: KafkaConsumer, log_range: LogRange, counts: Counter[str],
            stall_s: float = 30.0) -> Iterator[ConsumerRecord]:
    """Every record of the range, all partitions merged by Kafka timestamp (ties: completions first). A
    partition's fetching is paused while its buffer holds ``BUFFER_RECORDS``; the merge waits only for
    partitions whose buffer is empty and that have records left."""
    tps = {k: TopicPartition(*k) for k in log_range.end if log_range.start[k] < log_range.end[k]}
    consumer.assign(list(tps.values()))
    for k, tp in tps.items():
        consumer.seek(tp, log_range.start[k])
    buffers: dict[tuple[str, int], deque[ConsumerRecord]] = {k: deque() for k in tps}
    fetching = set(tps)  # partitions whose end is not reached yet
    last_progress = time.monotonic()
    while fetching or any(buffers.values()):
        while all(buffers[k] for k in fetching):
            heads = [(b[0].timestamp, k) for k, b in buffers.items() if b]
            if not heads:
                break
            yield buffers[min(heads)[1]].popleft()
        if not fetching:
            continue
        paused = [tps[k] for k in fetching if len(buffers[k]) >= BUFFER_RECORDS]
        consumer.pause(*paused)
        consumer.resume(*[tps[k] for k in fetching if len(buffers[k]) < BUFFER_RECORDS])
        # Everything fetched, never part of a fetch: kafka-python 3.0.12 parks the rest of a partition's
        # fetch when it is paused, and may never restore it (nor fetch that partition again).
        got = consumer.poll(timeout_ms=200, max_records=POLL_ALL)
        for tp, records in got.items():
            k = (tp.topic, tp.partition)
            buffers[k].extend(r for r in records if r.offset < log_range.end[k])
        for k in list(fetching):
            if consumer.position(tps[k]) >= log_range.end[k]:
                fetching.discard(k)
        if got:
            last_progress = time.monotonic()
        elif time.monotonic() - last_progress > stall_s:
            log.warning("no records from %s for %.0f s before their end offsets: ending the export there",
                        sorted(fetching), stall_s)
            counts["stalled_partitions"] += len(fetching)
            fetching.clear()


ROW_GROUP_BYTES = 64 << 20
"""A row group is written once its rows hold this many bytes of token ids and logprobs (long agent
trajectories), or ``row_group_rows`` rows, whichever comes first."""
CLOSED_REMEMBERED = 10
"""Ids of closed trajectories remembered, per open one allowed (``max_open``): a record for one of them is
counted late rather than opening it again (and evicting a live one)."""


class _Joiner:
    """Completions and rewards in event time -> one row per trajectory (the rules: module docstring)."""

    def __init__(self, options: ExportOptions, summary: ExportSummary, sink: _Sink, topics: Topics) -> None:
        self.o, self.summary, self.sink, self.topics = options, summary, sink, topics
        self.counts = summary.counts
        self.open: OrderedDict[str, _Trajectory] = OrderedDict()
        """Open trajectories, the one longest without a call first."""
        self.closing: list[tuple[int, int, str]] = []
        """(close at ms, sequence, trajectory id) of rewarded open trajectories: a heap."""
        self.closed: OrderedDict[str, bool] = OrderedDict()
        """Recently closed trajectory ids -> whether they had a reward (to name late records; bounded)."""
        self.others: OrderedDict[str, None] = OrderedDict()
        """Trajectories of another policy than ``ExportOptions.policy`` (bounded like ``closed``)."""
        self.now_ms = 0
        self.rows: list[dict[str, Any]] = []
        """Rows not written yet: a row group's."""
        self.row_bytes = 0
        """Their token ids and logprobs, in bytes."""
        self._seq = 0

    def add(self, message: ConsumerRecord) -> None:
        ts = message.timestamp
        if (self.o.since_ms is not None and ts < self.o.since_ms) or (self.o.until_ms is not None and ts > self.o.until_ms):
            self.counts["outside_time_range"] += 1
            return
        try:
            record = decode(message.value)
        except RecordError as exc:
            self.counts[exc.reason] += 1
            return
        self.now_ms = max(self.now_ms, ts)
        self._expire()  # first: a record after a trajectory's close is late
        if message.topic == self.topics.completions and isinstance(record, CompletionRecord):
            self._completion(record, message)
        elif message.topic == self.topics.rewards and isinstance(record, RewardRecord):
            self._reward(record, ts)
        elif isinstance(record, JudgeRequest):
            self.counts["judge_request"] += 1  # a request for a reward, not one
        else:
            self.counts["wrong_topic"] += 1

    def _completion(self, rec: CompletionRecord, message: ConsumerRecord) -> None:
        if self.o.purpose != "all" and rec.purpose != self.o.purpose:
            self.counts[f"purpose_{rec.purpose}"] += 1
            return
        if self.o.policy is not None and rec.policy_name is not None and rec.policy_name != self.o.policy:
            self.counts["other_policy"] += 1
            self._other(rec.trajectory_id)
            return
        if rec.trajectory_id in self.closed:
            self.counts["late_completion"] += 1
            return
        t = self._trajectory(rec.trajectory_id)
        key = (rec.request_id, rec.choice_index)
        if key in t.seen:
            self.counts["duplicate_completion"] += 1
            return
        t.seen.add(key)
        t.calls.append(_Call(rec, message.partition, message.offset, message.timestamp))
        t.last_ms = self.now_ms
        self.open.move_to_end(t.trajectory_id)
        self.counts["completions"] += 1

    def _other(self, tid: str) -> None:
        """Another policy's trajectory: closed unwritten (its reward, before or after, goes with it)."""
        t = self.open.pop(tid, None)
        if t is not None and t.reward is not None:
            self.counts["other_policy"] += 1
        self.others[tid] = None
        while len(self.others) > CLOSED_REMEMBERED * self.o.max_open:
            self.others.popitem(last=False)

    def _reward(self, rec: RewardRecord, ts: int) -> None:
        tid = rec.trajectory_id
        if self.o.policy is not None and rec.policy is not None and rec.policy != self.o.policy:
            self.counts["other_policy_reward"] += 1
            return
        if tid in self.others:
            self.counts["other_policy"] += 1
            return
        if tid in self.closed:
            self.counts["duplicate_reward" if self.closed[tid] else "late_reward"] += 1
            return
        t = self._trajectory(tid)
        if t.reward is not None:
            self.counts["duplicate_reward"] += 1
            return
        t.reward = rec
        self.counts["rewards"] += 1
        self._seq += 1
        heapq.heappush(self.closing, (ts + round(self.o.reward_grace_s * 1000), self._seq, tid))

    def _trajectory(self, tid: str) -> _Trajectory:
        t = self.open.get(tid)
        if t is None:
            t = self.open[tid] = _Trajectory(tid, self.now_ms)
            if len(self.open) > self.o.max_open:
                self._close(next(iter(self.open)), "evicted")
            self.summary.peak_open = max(self.summary.peak_open, len(self.open))
        return t

    def _expire(self) -> None:
        while self.closing and self.closing[0][0] < self.now_ms:
            self._close(heapq.heappop(self.closing)[2], None)
        ttl_ms = round(self.o.open_ttl_s * 1000)
        while self.open:
            t = next(iter(self.open.values()))
            if t.reward is not None or t.last_ms + ttl_ms >= self.now_ms:
                break
            self._close(t.trajectory_id, None)

    def _close(self, tid: str, reason: str | None) -> None:
        t = self.open.pop(tid, None)
        if t is None:  # already closed (evicted before its grace ran out)
            return
        if reason:
            self.counts[reason] += 1
        self.closed[tid] = t.reward is not None
        while len(self.closed) > CLOSED_REMEMBERED * self.o.max_open:
            self.closed.popitem(last=False)
        if not t.calls:
            self.counts["reward_without_completions"] += 1
            return
        if t.reward is None:
            self.summary.unrewarded += 1
            if not self.o.unrewarded:
                return
        elif self.o.min_reward is not None and t.reward.reward < self.o.min_reward:
            self.counts["below_min_reward"] += 1
            return
        self.rows.append(trajectory_row(t))
        self.summary.rows += 1
        self.row_bytes += sum(c.record.prompt_token_ids.nbytes + 2 * c.record.completion_token_ids.nbytes
                              for c in t.calls)
        if len(self.rows) >= self.o.row_group_rows or self.row_bytes >= ROW_GROUP_BYTES:
            self.sink.write(self.rows)
            self.rows, self.row_bytes = [], 0

    def finish(self) -> None:
        """The end of the range: every open trajectory closes (rewarded ones are written)."""
        for tid in list(self.open):
            self._close(tid, None)
        self.closing.clear()
        if self.rows:
            self.sink.write(self.rows)
            self.rows = []


def _json(value: Any) -> str | None:
    return None if value is None else orjson.dumps(value).decode()


def _call_row(c: _Call) -> dict[str, Any]:
    r = c.record
    return {
        "request_id": r.request_id, "choice_index": r.choice_index, "purpose": r.purpose, "group_id": r.group_id,
        "key_id": r.key_id, "model": r.model, "endpoint": r.endpoint, "upstream": r.upstream,
        "policy_name": r.policy_name, "policy_version": r.policy_version,
        "version_spans": None if r.version_spans is None else [list(s) for s in r.version_spans],
        "prompt_token_ids": r.prompt_token_ids,
        "completion_token_ids": r.completion_token_ids, "logprobs": r.logprobs, "response_text": r.response_text,
        "finish_reason": r.finish_reason, "request_json": _json(r.request), "tool_calls_json": _json(r.tool_calls),
        "usage_json": _json(r.usage), "created": r.created, "ttft_s": r.ttft_s, "total_s": r.total_s,
        "log_partition": c.partition, "log_offset": c.offset, "log_timestamp_ms": c.timestamp_ms,
    }


def trajectory_row(t: _Trajectory) -> dict[str, Any]:
    """A trajectory's row (``SCHEMA``): its calls ordered by ``created`` (the gateway's clock), ties in
    event-time order; group id as the trainer takes it."""
    calls = sorted(t.calls, key=lambda c: c.record.created)
    rw = t.reward
    group_id = (rw.group_id if rw is not None else None) or next(
        (c.record.group_id for c in calls if c.record.group_id), t.trajectory_id)
    return {
        "trajectory_id": t.trajectory_id, "group_id": group_id, "group_size": rw.group_size if rw else None,
        "reward": rw.reward if rw else None,
        "reward_metrics": [{"name": k, "value": v} for k, v in rw.metrics.items()] if rw else None,
        "judged_by": rw.judged_by if rw else None, "explanation": rw.explanation if rw else None,
        "reward_key_id": rw.key_id if rw else None, "reward_created": rw.created if rw else None,
        "key_id": next((c.record.key_id for c in calls if c.record.key_id), None),
        "policy": next((c.record.policy_name for c in calls if c.record.policy_name), rw.policy if rw else None),
        "policy_versions": sorted({c.record.policy_version for c in calls}), "n_calls": len(calls),
        "calls": [_call_row(c) for c in calls],
    }


class _Sink:
    def write(self, rows: list[dict[str, Any]]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class _ParquetSink(_Sink):
    """One row group per ``write`` (zstd), so the file grows as the export goes."""

    def __init__(self, path: Path) -> None:
        self.writer = pq.ParquetWriter(path, SCHEMA, compression="zstd")

    def write(self, rows: list[dict[str, Any]]) -> None:
        self.writer.write_table(pa.Table.from_pylist(rows, schema=SCHEMA))

    def close(self) -> None:
        self.writer.close()


class _JsonlSink(_Sink):
    """One JSON object a line, the shape of ``SCHEMA``'s rows (token ids and logprobs as number lists)."""

    OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE

    def __init__(self, path: Path) -> None:
        self.file = open(path, "wb")  # noqa: SIM115 (closed by close())

    def write(self, rows: list[dict[str, Any]]) -> None:
        self.file.write(b"".join(orjson.dumps(row, option=self.OPTIONS) for row in rows))

    def close(self) -> None:
        self.file.close()
