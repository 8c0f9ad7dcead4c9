"""What the daemon trains on: ready groups as Arrow batches, from the live log or from saved Parquet.

``StreamGroups`` decodes raw records (bad ones counted as ``bad_<reason>`` and skipped), feeds the
assembler and queues each group that becomes ready. Staleness is judged when a group becomes ready and
again, against the version about to be trained, before it is handed out, so no trained sample is more
than ``max_lag`` versions behind. The queue holds at most ``max_ready_groups``; beyond that the oldest
group is dropped (``groups_dropped_overflow``). Groups still queued keep their raw records, which are
part of ``pending_raw()`` so that a checkpoint loses nothing; a dropped group's records leave with it
(its id stays among the closed groups), so a restart neither retrains nor resurrects it.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import Counter

import pyarrow as pa

from streamrl.broker.schema import CompletionRecord, RecordError, RewardRecord, decode

from .assembler import COMPLETION, Assembler, ReadyGroup
from .batch import group_batch, load_batches, usable_group
from .config import TrainerConfig
from .source import RecordSource


class GroupSource(ABC):
    counts: Counter[str]

    @abstractmethod
    def next_groups(self, n: int, current_version: int, timeout_s: float) -> list[pa.RecordBatch]:
        """Exactly ``n`` group batches once that many are ready, else ``[]`` after at most ``timeout_s``."""

    @property
    def exhausted(self) -> bool:
        return False

    def offsets(self) -> dict[str, int]:
        return {}

    def pending_raw(self) -> list[tuple[str, bytes]]:
        return []

    def done_ids(self) -> list[str]:
        return []

    def commit(self, offsets: dict[str, int]) -> None:  # noqa: B027 - optional for backends
        pass

    def close(self) -> None:  # noqa: B027
        pass


class StreamGroups(GroupSource):
    def __init__(self, records: RecordSource, config: TrainerConfig,
                 restore: list[tuple[str, bytes]] = (), done: list[str] = ()) -> None:
        self.records = records
        self.config = config
        self.assembler = Assembler(group_size=config.group_size, group_timeout_s=config.group_timeout_s,
                                   ttl_s=config.trajectory_ttl_s, max_trajectories=config.max_pending_trajectories)
        self.counts = self.assembler.counts
        self.ready: list[tuple[ReadyGroup, int]] = []
        """Usable groups in the order they became ready, each with the version it was last judged against."""
        for stream, value in restore:  # before mark_done: groups ready but untrained were closed already
            self._feed(stream, value)
        self.assembler.mark_done(list(done))

    def _feed(self, stream: str, value: bytes | None) -> None:
        try:
            record = decode(value)
        except RecordError as exc:
            self.counts[f"bad_{exc.reason}"] += 1
            return
        want = CompletionRecord if stream == COMPLETION else RewardRecord
        if not isinstance(record, want):
            self.counts["bad_wrong_kind"] += 1
            return
        self.assembler.add(record, value)  # type: ignore[arg-type]

    def next_groups(self, n: int, current_version: int, timeout_s: float) -> list[pa.RecordBatch]:
        deadline = time.monotonic() + timeout_s
        while True:
            for r in self.records.poll(max(deadline - time.monotonic(), 0.0)):
                self._feed(r.stream, r.value)
            for g in self.assembler.poll():
                self._enqueue(g, current_version)
            self._rejudge(current_version)
            while len(self.ready) > self.config.max_ready_groups:
                self.ready.pop(0)
                self.counts["groups_dropped_overflow"] += 1
            if len(self.ready) >= n:
                out, self.ready = self.ready[:n], self.ready[n:]
                return [group_batch(g, std_norm=self.config.advantage_std_norm, counts=self.counts) for g, _ in out]
            if time.monotonic() >= deadline:
                return []

    def _enqueue(self, group: ReadyGroup, version: int) -> None:
        g = usable_group(group, current_version=version, max_lag=self.config.max_lag, counts=self.counts)
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
                self._enqueue(g, version)

    def offsets(self) -> dict[str, int]:
        return self.records.offsets()

    def pending_raw(self) -> list[tuple[str, bytes]]:
        return [r for g, _ in self.ready for r in g.raw] + self.assembler.pending_raw()

    def done_ids(self, limit: int = 20_000) -> list[str]:
        return list(self.assembler.done)[-limit:]

    def commit(self, offsets: dict[str, int]) -> None:
        self.records.commit(offsets)

    def close(self) -> None:
        self.records.close()


class ReplayGroups(GroupSource):
    """Saved batches (``--save-batches``), in file order; advantages as saved, staleness not re-judged."""

    def __init__(self, directory: str, start: dict[str, int] | None = None) -> None:
        self.consumed = (start or {}).get("replay", 0)
        self.batches = load_batches(directory)[self.consumed:]
        self.counts: Counter[str] = Counter()

    def next_groups(self, n: int, current_version: int, timeout_s: float) -> list[pa.RecordBatch]:
        """The next ``n`` saved batches (fewer at the very end of the directory)."""
        out, self.batches = self.batches[:n], self.batches[n:]
        self.consumed += len(out)
        self.counts["groups_ready"] += len(out)
        return out

    def offsets(self) -> dict[str, int]:
        return {"replay": self.consumed}

    @property
    def exhausted(self) -> bool:
        return len(self.batches) < 1
