"""Ready batches with explicit acknowledgement: the one way any learner, the daemon included, takes its
steps from the live log (or from saved batches).

``next()`` hands out a step's record batch (``BATCH_SCHEMA``, stamped with its sequence number) chosen by
the feed's policies (``feed.py``: freshest first or backpressure, the staleness cap against the version
acknowledged last, the step's token budget). Before it does, the position after that batch is written
down (``feed_state.py``); ``ack(batch, adapter_version)`` says the learner's checkpoint of that version
holds it. A learner that acknowledges only after its checkpoint is durable, and before it asks for the
next batch, trains every group exactly once across crashes of either side.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator

import pyarrow as pa

from .batch import batch_seq, with_seq
from .config import TrainerConfig
from .feed import GroupSource, ReplayBatches, StreamGroups
from .feed_state import FeedLog, FeedState


def open_source(c: TrainerConfig, start: FeedState | None) -> GroupSource:
    """Saved batches (``replay``) or the live log, positioned at ``start``."""
    if c.replay:
        return ReplayBatches(c.replay, start)
    from streamrl.broker.topics import Topics

    from .source import KafkaRecordSource

    records = KafkaRecordSource(c.kafka.bootstrap_servers, Topics(c.kafka.topic_prefix), c.group_id,
                                start.offsets if start else None, security=c.kafka)
    return StreamGroups(records, c, start)


class BatchStream:
    """A learner's stream of step batches; positions and acknowledgements in ``config.state_path``."""

    def __init__(self, config: TrainerConfig, *, version: int | None = None, acked_seq: int | None = None,
                 initial: FeedState | None = None, stop: threading.Event | None = None) -> None:
        """``version``: the version of the learner's checkpoint (None: no checkpoint, start where the stream's
        own acknowledgements say); ``acked_seq``: instead, the last batch the learner acknowledged (out of
        process); ``initial``: the position of a stream that has none yet."""
        self.config = config
        self.log = FeedLog(config.state_path)
        resumed = self.log.resume(version, acked_seq=acked_seq, initial=initial)
        self.version = resumed.version
        """The learner's version as last acknowledged: staleness is judged against it."""
        self.seq = self.acked = resumed.seq
        self.stop = stop or threading.Event()
        self.source = open_source(config, resumed.state)
        self._offsets: dict[str, int] = {}
        """Offsets of the position after the newest batch handed out (committed to Kafka on its ack)."""

    @property
    def counts(self) -> Counter[str]:
        """Every outcome of the feed (records, groups, bad batches): docs/trainer.md lists them."""
        return self.source.counts

    @property
    def exhausted(self) -> bool:
        """A replay has no batch left (a live stream never is)."""
        return self.source.exhausted

    def next(self, timeout_s: float | None = None) -> pa.RecordBatch | None:
        """The next step's batch, or None when none was ready within ``timeout_s`` (default
        ``poll_timeout_s``). Its position is on disk before it is returned."""
        c = self.config
        record = self.source.next_batch(c.feed.groups_per_step, self.version,
                                        c.feed.poll_timeout_s if timeout_s is None else timeout_s)
        if record is None:
            return None
        state = self.source.state()
        self.log.prepare(self.seq + 1, state)
        self.seq += 1
        self._offsets = state.offsets
        return with_seq(record, self.seq)

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        """Batches as they become ready, until ``stop`` is set or a replay ends."""
        while not self.stop.is_set():
            record = self.next()
            if record is not None:
                yield record
            elif self.exhausted:
                return

    def ack(self, batch: pa.RecordBatch, adapter_version: int) -> None:
        """The learner's checkpoint of ``adapter_version`` holds ``batch`` (the newest handed out) and every
        batch before it: a restart continues after it. Also commits the offsets to Kafka (monitoring)."""
        seq = batch_seq(batch)
        if seq != self.seq:
            raise ValueError(f"ack of batch {seq}: acknowledge the newest batch handed out ({self.seq}), which "
                             "stands for every batch before it")
        if adapter_version < self.version:
            raise ValueError(f"ack at version {adapter_version}, below the version acknowledged before ({self.version})")
        self.log.ack(seq, adapter_version)
        self.acked, self.version = seq, adapter_version
        self.source.commit(self._offsets)

    @property
    def offsets(self) -> dict[str, int]:
        """The next offset of every partition after the newest batch handed out."""
        return dict(self._offsets)

    def lag(self) -> int | None:
        """Records in Kafka not yet read (None: unknown)."""
        return self.source.lag()

    def close(self) -> None:
        self.source.close()

    def __enter__(self) -> BatchStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
