"""Batches on disk and on the wire, byte for byte as the stream built them: Parquet (``--save-batches``,
``--replay``) and Arrow IPC (``streamrl batches``: a file per step, or one stream of steps on stdout).

Every reader admits what it reads through ``read_batch``: an older version is upgraded, a newer or
malformed one refused with a ``BatchError``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from .batch import BATCH_SCHEMA, SEQ_KEY, batch_seq, read_batch, with_seq


def _atomic(path: Path) -> Path:
    """The temp name ``path`` is written under before the rename (a reader never sees half a file)."""
    return path.with_name(f".{path.name}.tmp")


def save_parquet(record: pa.RecordBatch, directory: str | Path, name: str) -> Path:
    """``record`` as ``<directory>/<name>.parquet`` (written to a temp name, then renamed)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{name}.parquet"
    pq.write_table(pa.Table.from_batches([record]), _atomic(path))
    _atomic(path).replace(path)
    return path


def read_parquet(path: str | Path) -> pa.RecordBatch:
    return read_batch(pq.read_table(path))


def batch_files(directory: str | Path) -> list[Path]:
    """The saved batches under ``directory``, in file-name order."""
    return sorted(Path(directory).glob("*.parquet"))


def write_ipc_file(record: pa.RecordBatch, path: str | Path) -> Path:
    """One step as an Arrow IPC file (written to a temp name, fsynced, then renamed)."""
    path = Path(path)
    with pa.OSFile(str(_atomic(path)), "wb") as sink, pa.ipc.new_file(sink, record.schema) as writer:
        writer.write_batch(record)
    with open(_atomic(path), "rb") as f:
        os.fsync(f.fileno())
    _atomic(path).replace(path)
    return path


def read_ipc_file(path: str | Path) -> pa.RecordBatch:
    """The step of an IPC file ``write_ipc_file`` wrote (its batches as one, if a writer split it)."""
    with pa.memory_map(str(path)) as source:
        return read_batch(pa.ipc.open_file(source).read_all())


class IpcStreamWriter:
    """Steps as one Arrow IPC stream (``streamrl batches --to -``). The stream's schema is
    ``BATCH_SCHEMA``; each step's sequence number travels as the message's custom metadata."""

    def __init__(self, sink: BinaryIO) -> None:
        self.sink = sink
        self.writer = pa.ipc.new_stream(sink, BATCH_SCHEMA)

    def write(self, record: pa.RecordBatch) -> None:
        seq = batch_seq(record)
        meta = {SEQ_KEY: str(seq).encode()} if seq is not None else None
        self.writer.write_batch(record.replace_schema_metadata(BATCH_SCHEMA.metadata), custom_metadata=meta)
        self.sink.flush()

    def close(self) -> None:
        self.writer.close()
        self.sink.flush()


def read_ipc_stream(source: BinaryIO | pa.NativeFile) -> Iterator[pa.RecordBatch]:
    """The steps of an IPC stream ``IpcStreamWriter`` wrote, each stamped with its sequence number."""
    reader = pa.ipc.open_stream(source)
    while True:
        try:
            record, meta = reader.read_next_batch_with_custom_metadata()
        except StopIteration:
            return
        record = read_batch(record.replace_schema_metadata(reader.schema.metadata))
        yield with_seq(record, int(meta[SEQ_KEY])) if meta is not None and SEQ_KEY in meta else record
