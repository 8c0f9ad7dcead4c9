"""Where a batch stream stands, on disk: what makes a learner's acknowledgements exactly-once.

A stream's position (``FeedState``: the next offset of every partition, the raw bytes of every record
consumed but not yet handed out, the ids of closed groups, the publication times of recent versions)
is written as ``feed-<seq>.arrow`` (Arrow IPC: the raw records as rows, the rest as JSON metadata)
*before* batch ``seq`` is handed out: the position after that batch. ``ack(seq, version)`` then writes
``feed_ack.json``: the learner holds every batch up to ``seq`` durably, as its version ``version``.

On a restart the learner says which version its own checkpoint is (or, out of process, which batch it
acknowledged last); ``resume`` takes the acknowledged position, or the one after the batch handed out
last when the learner's checkpoint is newer than the acknowledgement (it crashed between its checkpoint
and its ``ack``). So every group is trained once whatever moment the learner or the stream is killed,
provided the learner checkpoints and acknowledges before it asks for the next batch.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

log = logging.getLogger("streamrl.trainer")

ACK_FILE = "feed_ack.json"
_STATE_FILE = re.compile(r"^feed-(\d+)\.arrow$")
_META_KEY = b"streamrl.feed"
_RAW_SCHEMA = pa.schema([("stream", pa.string()), ("value", pa.binary())])


class FeedStateError(RuntimeError):
    """The learner's checkpoint and the stream's acknowledgements disagree in a way that cannot be exact."""


@dataclass
class FeedState:
    offsets: dict[str, int] = field(default_factory=dict)
    """Next offset per ``"<topic>:<partition>"`` (``{"replay": n}`` for a replay)."""
    pending: list[tuple[str, bytes]] = field(default_factory=list)
    """(stream, raw value) of every record consumed but not yet handed out, in arrival order."""
    done: list[str] = field(default_factory=list)
    """Ids of recently closed groups (trained, stale or shed): their later records are ``late``."""
    published: dict[int, float] = field(default_factory=dict)
    """Epoch seconds each recent version was first trained against (``feed.py``'s stale skipping)."""


@dataclass(frozen=True)
class Resumed:
    state: FeedState | None
    """The position to continue from; None: the beginning (or Kafka's committed offsets)."""
    seq: int
    """The last batch the learner holds; the next one handed out is ``seq + 1``."""
    version: int
    """The learner's version holding it (the stream judges staleness against it)."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FeedLog:
    """The ``feed-<seq>.arrow`` states and ``feed_ack.json`` of one stream, in ``directory``."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    def _path(self, seq: int) -> Path:
        return self.directory / f"feed-{seq:010d}.arrow"

    def _seqs(self) -> list[int]:
        if not self.directory.is_dir():
            return []
        return sorted(int(m.group(1)) for p in self.directory.iterdir() if (m := _STATE_FILE.match(p.name)))

    def _read_ack(self) -> tuple[int, int] | None:
        path = self.directory / ACK_FILE
        if not path.exists():
            return None
        ack = json.loads(path.read_text())
        return int(ack["seq"]), int(ack["version"])

    def resume(self, version: int | None = None, *, acked_seq: int | None = None,
               initial: FeedState | None = None) -> Resumed:
        """Where to continue, given the learner's checkpoint ``version`` (in process) or the last batch it
        acknowledged, ``acked_seq`` (out of process); ``initial`` is the position of a fresh log."""
        ack = self._read_ack()
        seqs = self._seqs()
        seq, acked_version = ack if ack is not None else (0, version or 0)
        if version is not None and version < acked_version:
            raise FeedStateError(
                f"the learner resumes at version {version} but {self.directory / ACK_FILE} acknowledges batch "
                f"{seq} at version {acked_version}: its checkpoint is older than its acknowledgements (restore "
                "the newer checkpoint, or delete the stream's state directory to start the stream over)")
        prepared = max((s for s in seqs if s > seq), default=None)
        if prepared is not None and (
                (acked_seq is not None and acked_seq >= prepared)
                or (acked_seq is None and version is not None and version > acked_version)):
            log.info("the learner holds batch %d (version %s) that it did not acknowledge: continuing after it",
                     prepared, version)
            seq = prepared
        if version is not None:
            acked_version = max(acked_version, version)
        self._write_ack(seq, acked_version)
        for s in seqs:
            if s != seq:
                self._path(s).unlink(missing_ok=True)
        state = self._read(seq) if seq in seqs else (initial if seq == 0 else None)
        if seq > 0 and seq not in seqs:
            raise FeedStateError(f"{self.directory}: batch {seq} is acknowledged but its state file is missing")
        return Resumed(state, seq, acked_version)

    def prepare(self, seq: int, state: FeedState) -> None:
        """Write the position after batch ``seq``, before it is handed out (and drop older unacknowledged ones)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        ack = self._read_ack()
        keep = {seq, ack[0] if ack else 0}
        meta = {"offsets": state.offsets, "done": state.done,
                "published": {str(k): v for k, v in state.published.items()}}
        table = pa.table({"stream": [s for s, _ in state.pending], "value": [v for _, v in state.pending]},
                         schema=_RAW_SCHEMA.with_metadata({_META_KEY: json.dumps(meta).encode()}))
        path = self._path(seq)
        tmp = path.with_name(f".{path.name}.tmp")
        with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        tmp.replace(path)
        _fsync_dir(self.directory)
        for s in self._seqs():
            if s not in keep:
                self._path(s).unlink(missing_ok=True)

    def ack(self, seq: int, version: int) -> None:
        """The learner holds every batch up to ``seq`` durably, as its version ``version``."""
        self._write_ack(seq, version)
        for s in self._seqs():
            if s < seq:
                self._path(s).unlink(missing_ok=True)

    def _write_ack(self, seq: int, version: int) -> None:
        write_ack_file(self.directory / ACK_FILE, seq, version)

    def _read(self, seq: int) -> FeedState:
        with pa.memory_map(str(self._path(seq))) as source:
            table = pa.ipc.open_file(source).read_all()
        meta = json.loads(table.schema.metadata[_META_KEY])
        return FeedState({k: int(v) for k, v in meta["offsets"].items()},
                         list(zip(table.column("stream").to_pylist(), table.column("value").to_pylist(), strict=True)),
                         list(meta["done"]), {int(k): float(v) for k, v in meta["published"].items()})


def write_ack_file(path: Path, seq: int, version: int) -> None:
    """An acknowledgement ``{"seq", "version"}`` written durably (temporary name, fsync, rename, fsync of the
    directory): after this returns, a restart finds it. The feed's own ack and a learner's both go through here."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        json.dump({"seq": seq, "version": version}, f)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    _fsync_dir(path.parent)
