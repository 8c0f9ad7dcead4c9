"""``Spool``: an append-only, bounded, checksummed log of Kafka records on local disk, for records that
Kafka could not take yet. One process owns a spool directory (an exclusive ``flock``); it appends
records and replays them in the order appended, from a cursor that is persisted as they are delivered.

On disk: segment files ``<n>.seg`` (n = 0, 1, 2, ... zero-padded, a new one once the current one holds
``segment_bytes``) of frames, and ``cursor`` (``<segment> <offset>``: where the first undelivered frame
starts). A frame is ``MAGIC`` (2 bytes), the payload's length (u32) and the CRC-32C of length and
payload (u32), then the payload: timestamp in ms (i64), topic length (u16), key length (i32, -1 for
none), topic, key, value. Opening a spool reads every frame after the cursor: a frame that fails its
checksum is skipped and counted (``corrupt``), reading resumes at the next frame that checks; bytes at
the end of the last segment that do not make a whole valid frame (a write torn by a crash) are cut off.

Durability: ``append`` writes the frames with one ``write`` call, so what was appended survives the
death of the process (the kernel holds it); with ``sync=True`` it also ``fdatasync``s the segment
before returning, so it survives a machine crash. ``sync()`` does the same for what was appended
before. The cursor is written (replaced atomically) after each delivered batch without an fsync: a
crash can only make it older, so at worst records are delivered again, never skipped.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from crc32c import crc32c

log = logging.getLogger(__name__)

MAGIC = b"\xa5\x5a"
HEAD = struct.Struct("<2sII")
"""magic, payload length, CRC-32C of (length, payload)."""
META = struct.Struct("<qHi")
"""timestamp ms, topic length, key length (-1: no key)."""
SUFFIX = ".seg"


@dataclass(frozen=True, slots=True)
class SpoolRecord:
    topic: str
    key: bytes | None
    value: bytes
    timestamp_ms: int


def encode_frame(r: SpoolRecord) -> bytes:
    topic = r.topic.encode()
    payload = META.pack(r.timestamp_ms, len(topic), -1 if r.key is None else len(r.key)) + topic + (r.key or b"") + r.value
    length = len(payload).to_bytes(4, "little")
    return HEAD.pack(MAGIC, len(payload), crc32c(payload, crc32c(length))) + payload


def decode_payload(payload: bytes | memoryview) -> SpoolRecord:
    ts, tlen, klen = META.unpack_from(payload)
    at = META.size
    topic = bytes(payload[at:at + tlen]).decode()
    at += tlen
    key = None if klen < 0 else bytes(payload[at:at + klen])
    at += max(klen, 0)
    return SpoolRecord(topic, key, bytes(payload[at:]), ts)


def scan(data: bytes, start: int = 0) -> tuple[list[int], int, int]:
    """The valid frames of ``data`` from ``start``: their start offsets; how many corrupt regions lie
    between them (bytes that are not a valid frame, followed by one that is); and where the last valid
    frame ends. Bytes after that end are not a whole valid frame: a torn write in the last segment."""
    frames: list[int] = []
    corrupt, pos, end, bad = 0, start, start, False
    n = len(data)
    view = memoryview(data)
    while pos + HEAD.size <= n:
        magic, length, crc = HEAD.unpack_from(data, pos)
        stop = pos + HEAD.size + length
        if magic == MAGIC and stop <= n and crc32c(view[pos + HEAD.size:stop],
                                                        crc32c(length.to_bytes(4, "little"))) == crc:
            frames.append(pos)
            corrupt += bad
            pos = end = stop
            bad = False
            continue
        bad = True  # resynchronise: the next frame starts with MAGIC and checks
        nxt = data.find(MAGIC, pos + 1)
        if nxt < 0:
            break
        pos = nxt
    return frames, corrupt, end


class SpoolFull(Exception):
    """Appending would take the spool over its bound in bytes."""


class Spool:
    """Append records, read them back in order from the cursor, commit what was delivered.

    Thread-safe: one thread may append while another reads and commits."""

    def __init__(self, directory: str | Path, max_bytes: int = 1 << 30, segment_bytes: int = 16 << 20,
                 lock_wait_s: float = 0.0) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.segment_bytes = max_bytes, segment_bytes
        self.lock = threading.Lock()
        self._lock_fd = os.open(self.dir / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + lock_wait_s
        while True:  # (a predecessor may still be delivering what it held: wait for it up to lock_wait_s)
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(self._lock_fd)
                    raise RuntimeError(f"spool directory {self.dir} is in use by another process") from None
                time.sleep(0.1)
        self.corrupt = 0
        """Corrupt regions skipped (frames that failed their checksum)."""
        self.torn_bytes = 0
        """Bytes cut off the end of the last segment at open (a write torn by a crash)."""
        self.records = 0
        """Records appended and not yet committed."""
        self.bytes = 0
        """Bytes of the segment files on disk (what the bound counts)."""
        self.full = False
        """The last append was refused for want of room (until one fits again)."""
        self._open()

    # -- layout -------------------------------------------------------------------------------------
    def _path(self, seg: int) -> Path:
        return self.dir / f"{seg:020d}{SUFFIX}"

    def _segments(self) -> list[int]:
        return sorted(int(p.name[:-len(SUFFIX)]) for p in self.dir.glob(f"*{SUFFIX}"))

    def _read_cursor(self) -> tuple[int, int]:
        try:
            seg, off = (self.dir / "cursor").read_text().split()
            return int(seg), int(off)
        except FileNotFoundError:
            return -1, 0
        except ValueError:
            log.warning("spool %s: unreadable cursor, replaying every segment", self.dir)
            return -1, 0

    def _write_cursor(self, seg: int, off: int) -> None:
        tmp = self.dir / "cursor.tmp"
        tmp.write_text(f"{seg} {off}\n")
        os.replace(tmp, self.dir / "cursor")

    def _open(self) -> None:
        segs = self._segments()
        cseg, coff = self._read_cursor()
        for seg in [s for s in segs if s < cseg]:  # delivered; the process died before deleting it
            self._path(seg).unlink()
        segs = [s for s in segs if s >= cseg]
        if not segs:
            segs = [max(cseg, 0)]
            self._path(segs[0]).touch()
        if cseg != segs[0]:
            cseg, coff = segs[0], 0
        self.offsets: dict[int, list[int]] = {}
        """Start of every undelivered frame, per segment: filled at open and as frames are appended."""
        self.ends: dict[int, int] = {}
        """Where the last valid frame of each segment ends."""
        for seg in segs:
            data = self._path(seg).read_bytes()
            if seg == cseg:  # a cursor past the end: the file lost writes the cursor had seen (a machine crash)
                coff = min(coff, len(data))
            frames, corrupt, end = scan(data, coff if seg == cseg else 0)
            if end < len(data):
                if seg == segs[-1]:  # a torn write: cut it, so that appends go on after the last whole frame
                    self.torn_bytes = len(data) - end
                    os.truncate(self._path(seg), end)
                    log.warning("spool %s: cut %d bytes of a torn write at the end of segment %d", self.dir,
                                self.torn_bytes, seg)
                else:
                    corrupt += 1
            self.corrupt += corrupt
            self.offsets[seg], self.ends[seg] = frames, end
            self.records += len(frames)
            self.bytes += end if seg == segs[-1] else len(data)
        if self.corrupt:
            log.warning("spool %s: %d corrupt region(s) skipped", self.dir, self.corrupt)
        self.cursor = (cseg, coff)
        self.read_seg, self.read_off = self.cursor
        """Where the next ``read`` starts (ahead of the cursor while a batch is being delivered)."""
        self.head = segs[-1]
        self._fd = os.open(self._path(self.head), os.O_WRONLY | os.O_APPEND)
        self._dirty = False

    # -- writing ------------------------------------------------------------------------------------
    def append(self, records: list[SpoolRecord], sync: bool = False) -> None:
        """Append ``records`` in order (one write); raise ``SpoolFull`` and append none when they would
        take the spool over ``max_bytes``."""
        frames = [encode_frame(r) for r in records]
        data = b"".join(frames)
        with self.lock:
            if self.bytes + len(data) > self.max_bytes:
                self.full = True
                raise SpoolFull(f"spool {self.dir} holds {self.bytes} bytes; {len(data)} more would pass "
                                f"its bound of {self.max_bytes}")
            if self.ends[self.head] >= self.segment_bytes:
                self._roll()
            offsets = self.offsets[self.head]
            at = self.ends[self.head]
            for f in frames:
                offsets.append(at)
                at += len(f)
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
            self.ends[self.head] += len(data)
            self.full = False
            self.bytes += len(data)
            self.records += len(records)
            self._dirty = True
            if sync:
                os.fdatasync(self._fd)
                self._dirty = False

    def sync(self) -> None:
        """Make what was appended survive a machine crash (no-op when nothing new)."""
        with self.lock:
            if self._dirty:
                os.fdatasync(self._fd)
                self._dirty = False

    def _roll(self) -> None:
        if self._dirty:
            os.fdatasync(self._fd)
            self._dirty = False
        os.close(self._fd)
        self.head += 1
        self._fd = os.open(self._path(self.head), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.offsets[self.head], self.ends[self.head] = [], 0
        with contextlib.suppress(OSError):  # the new file's name durable too
            dfd = os.open(self.dir, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    # -- reading ------------------------------------------------------------------------------------
    def read(self, max_records: int = 1000, max_bytes: int = 4 << 20) -> tuple[list[SpoolRecord], tuple[int, int]]:
        """The next records after those already read (at least one if there is any, then up to the
        bounds), and the position after them, to ``commit`` once they are delivered."""
        out: list[SpoolRecord] = []
        size = 0
        with self.lock:
            seg, off = self.read_seg, self.read_off
        while len(out) < max_records and size < max_bytes:
            with self.lock:
                head = self.head
                if seg not in self.offsets:  # delivered and deleted, or not there yet
                    if seg >= head:
                        break
                    seg, off = seg + 1, 0
                    continue
                starts, seg_end = self.offsets[seg], self.ends[seg]
                i = bisect.bisect_left(starts, off)
                j = i
                while j < len(starts) and (j == i or starts[j] - starts[i] < max_bytes - size) \
                        and j - i < max_records - len(out):
                    j += 1
                stop = starts[j] if j < len(starts) else seg_end
            if i == j:
                if seg >= head:
                    break
                seg, off = seg + 1, 0
                continue
            with open(self._path(seg), "rb") as f:
                f.seek(starts[i])
                chunk = f.read(stop - starts[i])
            for k in range(i, j):
                at = starts[k] - starts[i]
                _, length, _ = HEAD.unpack_from(chunk, at)
                out.append(decode_payload(memoryview(chunk)[at + HEAD.size:at + HEAD.size + length]))
                size += HEAD.size + length
                off = starts[k] + HEAD.size + length
        with self.lock:
            self.read_seg, self.read_off = seg, off
        return out, (seg, off)

    def rewind(self) -> None:
        """Read again from the cursor (a batch that was not delivered)."""
        with self.lock:
            self.read_seg, self.read_off = self.cursor

    def commit(self, position: tuple[int, int], count: int) -> None:
        """``count`` records up to ``position`` (from ``read``) were delivered: persist the cursor and
        delete the segments wholly delivered."""
        seg, off = position
        with self.lock:
            self.records -= count
            self._write_cursor(seg, off)
            self.cursor = position
            if seg == self.head and off >= self.ends[seg] and self.ends[seg] >= self.segment_bytes:
                self._roll()  # a full head wholly delivered: start a new one so that this one can go
            for s in [s for s in self.offsets if s < self.cursor[0] or (s < self.head and s == seg and
                                                                          off >= self.ends[s])]:
                del self.offsets[s]
                del self.ends[s]
                path = self._path(s)
                with contextlib.suppress(FileNotFoundError):
                    self.bytes -= path.stat().st_size
                    path.unlink()

    @property
    def empty(self) -> bool:
        """Nothing appended that was not committed."""
        with self.lock:
            return self.records == 0

    def close(self) -> None:
        with self.lock:
            if self._dirty:
                os.fdatasync(self._fd)
            os.close(self._fd)
            os.close(self._lock_fd)
