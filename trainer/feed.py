"""Where a step's batch comes from: ready groups from the live log, or saved Parquet batches; the policies
that choose them. ``stream.py`` hands the batches out (the daemon and ``streamrl.batches`` alike).

``StreamGroups`` decodes raw records (bad ones counted as ``bad_<reason>`` and skipped), feeds the
assembler and queues each group that becomes ready. Staleness is judged when a group becomes ready and
again, against the version about to be trained, before it is handed out, so no trained sample is more
than ``max_lag`` versions behind (stale groups are dropped and counted).

What happens when generation outpaces training is ``config.feed.backlog``:

* ``wait`` (backpressure, not drops): while the queue holds ``max_ready_groups`` or more, reading is
  paused (``RecordSource.set_paused``: Kafka's ``pause()`` on every partition) and resumes once the queue
  has drained below the bound, so a producer faster than the trainer leaves its records waiting in Kafka
  (visible as consumer lag); groups are trained oldest first. The bound is soft by what was already
  read: one poll's records, or groups completed by a timeout, may take the queue past it, never unread
  records. Counted: ``reads_paused`` (pauses begun) and ``reads_paused_s`` (seconds paused in all). Time
  paused does not count towards the assembler's group timeouts and TTLs (its clock stops with the
  reads), since a group's missing records may be waiting unread in the log: backpressure must not turn
  them into partial groups and ``late`` records.
* ``freshest``: reads never pause; before a step, whatever the log has is read, the oldest ready groups
  beyond ``max_ready_groups`` are dropped (``groups_dropped_overload``), and the step takes the newest
  groups first. Traffic that does not wait for the trainer is trained while it is fresh, and what cannot
  be trained is dropped when it arrives, not after waiting until it is stale.

Skipping instead of reading (``freshest``): samples served by a version more than ``max_lag`` behind the
one being trained are stale, and every such sample was written to the log before the version after
them was published. So once the trainer has seen version ``V - max_lag`` published (in this process),
records written more than ``SKIP_MARGIN_S`` before that are stale whatever they hold, and the feed moves
past them without reading them (``RecordSource.skip_before``; counted ``records_skipped_stale``). A
reward is always written after its completions, so no usable trajectory loses its reward this way; a
trajectory whose first calls are skipped and later ones kept is trained on the kept calls (the later
prompts hold the earlier turns). Offsets move past the skipped records and are checkpointed as usual, so
a restart neither reads nor trains them.

A step takes ``groups_per_step`` groups at least and, when more are ready, more up to
``max_step_tokens`` tokens. Counted for the share of generated tokens trained on: ``tokens_generated``
(completion tokens of every group that became ready) and ``tokens_trained`` (of the groups handed out).

Groups still queued keep their raw records, which are part of ``state()`` so that a stream's saved
position (``feed_state.py``) loses nothing; a dropped (stale or overload) group's records leave with it (its id stays among the closed groups),
so a restart neither retrains nor resurrects it. Pausing never moves an offset: ``state()``'s offsets count
only records returned by ``poll``, all of which are fed.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections import Counter

import pyarrow as pa

from streamrl.broker.schema import CompletionRecord, JudgeRequest, RecordError, RewardRecord, decode

from .assembler import COMPLETION, Assembler, ReadyGroup
from .batch import BatchError, group_tokens, step_batch, usable_group
from .batch_io import batch_files, read_parquet
from .config import TrainerConfig
from .feed_state import FeedState
from .source import RecordSource

log = logging.getLogger("streamrl.trainer")


class GroupSource(ABC):
    counts: Counter[str]

    @abstractmethod
    def next_batch(self, n: int, current_version: int, timeout_s: float) -> pa.RecordBatch | None:
        """The batch of at least ``n`` groups once that many are ready, else None after at most ``timeout_s``."""

    @property
    def exhausted(self) -> bool:
        return False

    @abstractmethod
    def state(self) -> FeedState:
        """The position after the last batch handed out: what a restart continues from."""

    def lag(self) -> int | None:
        """Records in Kafka not yet read (``kafka_lag`` in each step's metrics); None when not known."""
        return None

    def commit(self, offsets: dict[str, int]) -> None:  # noqa: B027 - optional for backends
        pass

    def close(self) -> None:  # noqa: B027
        pass


SKIP_MARGIN_S = 5.0
"""Skipped records must be this much older than the publication that made them stale: room for the
clocks of the machines that wrote them (gateways) and of the trainer to differ."""


class StreamGroups(GroupSource):
    def __init__(self, records: RecordSource, config: TrainerConfig, start: FeedState | None = None,
                 skip_margin_s: float = SKIP_MARGIN_S) -> None:
        start = start or FeedState()
        self.records = records
        self.config = config
        feed = config.feed
        self.assembler = Assembler(group_size=feed.group_size, group_timeout_s=feed.group_timeout_s,
                                   ttl_s=feed.trajectory_ttl_s, max_trajectories=feed.max_pending_trajectories,
                                   policy=config.name)
        self.counts = self.assembler.counts
        self._key_ids = frozenset(config.key_ids)
        self.ready: list[tuple[ReadyGroup, int]] = []
        """Usable groups in the order they became ready, each with the version it was last judged against."""
        self._paused_at: float | None = None
        """When reads were last paused (monotonic clock); None while reading."""
        self._paused_s = 0.0
        """Seconds paused before the current pause."""
        self._seen_at: dict[int, float] = dict(start.published)
        """When each policy version was published (epoch seconds): from the checkpoint, then the time it
        was first trained against here (right after its publication)."""
        self.skip_margin_s = skip_margin_s
        for stream, value in start.pending:  # before mark_done: groups ready but untrained were closed already
            self._feed(stream, value)
        self.assembler.mark_done(list(start.done))

    def _feed(self, stream: str, value: bytes | None) -> None:
        try:
            record = decode(value)
        except RecordError as exc:
            self.counts[f"bad_{exc.reason}"] += 1
            return
        if isinstance(record, JudgeRequest):  # waits for ``streamrl judge``'s reward; never trained on
            self.counts["not_trained_judge_request"] += 1
            return
        want = CompletionRecord if stream == COMPLETION else RewardRecord
        if not isinstance(record, want):
            self.counts["bad_wrong_kind"] += 1
            return
        if self._key_ids and record.key_id not in self._key_ids:  # another tenant's traffic
            self.counts["not_trained_tenant"] += 1
            return
        self.assembler.add(record, value, now=self._clock())  # type: ignore[arg-type]

    def next_batch(self, n: int, current_version: int, timeout_s: float) -> pa.RecordBatch | None:
        """The batch of at least ``n`` groups once that many are ready (more up to ``max_step_tokens``), else
        None after at most ``timeout_s``."""
        # A caller asking for more than the bound (the daemon never does: the config forbids
        # max_ready_groups < groups_per_step) must not be starved by a pause it cannot drain.
        bound = max(self.config.feed.max_ready_groups, n)
        freshest = self.config.feed.backlog == "freshest"
        deadline = time.monotonic() + timeout_s
        if freshest:
            self._skip_stale(current_version)
        while True:
            if not freshest:
                self._hold(len(self.ready) >= bound)
            if not self.paused:  # read ahead without waiting when a step's worth is queued already
                wait = 0.0 if len(self.ready) >= n else max(deadline - time.monotonic(), 0.0)
                self._read(wait, to_the_end=freshest)
            for g in self.assembler.poll(self._clock()):
                self._enqueue(g, current_version)
            self._rejudge(current_version)
            if freshest:
                self._shed(bound)
            if len(self.ready) >= n:
                out = self._take(n, newest_first=freshest)
                if not freshest:
                    self._hold(len(self.ready) >= bound)
                return step_batch(out, std_norm=self.config.loss.advantage_std_norm, counts=self.counts,
                                  oldest_version=current_version - self.config.feed.max_lag)
            if time.monotonic() >= deadline:
                return None

    def _skip_stale(self, version: int) -> None:
        """At a new version, move past what was written before version ``version - max_lag`` was
        published (minus the margin): all of it is stale."""
        if version in self._seen_at:
            return
        self._seen_at[version] = time.time()
        published = self._seen_at.get(version - self.config.feed.max_lag)
        if published is not None:
            skip_to = int((published - self.skip_margin_s) * 1000)
            self.counts["records_skipped_stale"] += self.records.skip_before(skip_to)

    def published(self) -> dict[int, float]:
        """Publication times of the newest ``max_lag + 1`` versions, for the checkpoint."""
        newest = sorted(self._seen_at)[-(self.config.feed.max_lag + 1):]
        return {v: self._seen_at[v] for v in newest}

    def _read(self, wait: float, *, to_the_end: bool, budget_s: float = 5.0) -> None:
        """One poll (waiting at most ``wait`` for a first record); with ``to_the_end``, polls until the
        log has nothing more right now (or ``budget_s`` has passed), so that the freshest groups are
        among those read before a step chooses."""
        stop = time.monotonic() + budget_s
        while True:
            got = self.records.poll(wait)
            for r in got:
                self._feed(r.stream, r.value)
            if not to_the_end or not got or time.monotonic() >= stop:
                return
            wait = 0.0

    def _take(self, n: int, *, newest_first: bool) -> list[ReadyGroup]:
        """``n`` ready groups, then more while they fit in ``max_step_tokens``; returned (and the rest
        kept) in the order they became ready."""
        budget = self.config.feed.max_step_tokens
        order = range(len(self.ready) - 1, -1, -1) if newest_first else range(len(self.ready))
        chosen: dict[int, int] = {}
        """Index in ``ready`` -> the group's completion tokens."""
        tokens = 0
        for i in order:
            total, sampled = group_tokens(self.ready[i][0])
            if len(chosen) >= n and (budget == 0 or tokens + total > budget):
                break
            chosen[i] = sampled
            tokens += total
        out = [g for i, (g, _) in enumerate(self.ready) if i in chosen]
        self.ready = [x for i, x in enumerate(self.ready) if i not in chosen]
        self.counts["groups_trained"] += len(out)
        self.counts["tokens_trained"] += sum(chosen.values())
        return out

    def _shed(self, bound: int) -> None:
        """Drop the oldest ready groups beyond ``bound`` (their ids stay closed: never trained later)."""
        while len(self.ready) > bound:
            self.ready.pop(0)
            self.counts["groups_dropped_overload"] += 1

    @property
    def paused(self) -> bool:
        """Whether reads are paused because the ready queue is full."""
        return self._paused_at is not None

    def _paused_total(self, now: float) -> float:
        return self._paused_s + (now - self._paused_at if self._paused_at is not None else 0.0)

    def _clock(self) -> float:
        """The assembler's clock: monotonic time spent reading (it stands still while reads are paused)."""
        now = time.monotonic()
        return now - self._paused_total(now)

    def _hold(self, full: bool) -> None:
        """Pause reads when the ready queue is full, resume them when it is not (and count both)."""
        now = time.monotonic()
        if full and self._paused_at is None:
            self._paused_at = now
            self.counts["reads_paused"] += 1
            self.records.set_paused(True)
        elif not full and self._paused_at is not None:
            self._paused_s += now - self._paused_at
            self._paused_at = None
            self.records.set_paused(False)
        self.counts["reads_paused_s"] = round(self._paused_total(now), 3)

    def _enqueue(self, group: ReadyGroup, version: int, *, fresh: bool = True) -> None:
        if fresh:  # first judged: it counts as generated once, whatever becomes of it
            self.counts["tokens_generated"] += group_tokens(group)[1]
        g = usable_group(group, current_version=version, max_lag=self.config.feed.max_lag, counts=self.counts)
        if g is not None:
            self.ready.append((g, version))

    def _rejudge(self, version: int) -> None:
        """Judge again, against ``version``, the queued groups judged against an older one."""
        if all(v == version for _, v in self.ready):
            return
        queued, self.ready = self.ready, []
        for g, v in queued:
            if v == version:
                self.ready.append((g, v))
            else:
                self._enqueue(g, version, fresh=False)

    def state(self, done_limit: int = 20_000) -> FeedState:
        return FeedState(self.records.offsets(), [r for g, _ in self.ready for r in g.raw] + self.assembler.pending_raw(),
                         list(self.assembler.done)[-done_limit:], self.published())

    def commit(self, offsets: dict[str, int]) -> None:
        self.records.commit(offsets)

    def lag(self) -> int | None:
        return self.records.lag()

    def close(self) -> None:
        self.records.close()


class ReplayBatches(GroupSource):
    """Saved batches (``--save-batches``), in file-name order, ``n`` files per step, their rows as saved
    (advantages as saved, staleness not judged again). A file that is not a readable batch is counted
    ``bad_<reason>`` (``bad_batch_unknown_version``, ``bad_batch_malformed``, ...) and skipped."""

    def __init__(self, directory: str, start: FeedState | None = None) -> None:
        self.consumed = (start.offsets if start else {}).get("replay", 0)
        self.files = batch_files(directory)[self.consumed:]
        self.counts: Counter[str] = Counter()

    def next_batch(self, n: int, current_version: int, timeout_s: float) -> pa.RecordBatch | None:
        """The rows of the next ``n`` readable files as one batch (fewer at the very end)."""
        records = []
        while self.files and len(records) < n:
            path = self.files.pop(0)
            self.consumed += 1
            try:
                records.append(read_parquet(path))
            except (BatchError, pa.ArrowException, OSError) as exc:
                self.counts[f"bad_{exc.reason}" if isinstance(exc, BatchError) else "bad_batch_unreadable"] += 1
                log.error("skipping %s: %s", path, exc)
        self.counts["groups_ready"] += len(records)
        return pa.concat_batches(records) if records else None

    def state(self) -> FeedState:
        return FeedState({"replay": self.consumed})

    @property
    def exhausted(self) -> bool:
        return not self.files
