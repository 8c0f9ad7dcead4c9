"""The pipe between a server and its log-producer process: length-prefixed frames, written from the
server's thread without blocking (``PipeWriter``) and emptied in the producer process by a thread of its
own (``FrameReader``). Why each end works the way it does is in its docstring: both were shaped by
measurements of the gateway's response-time tail (docs/history/benchmarks-2026-12.md, "Gateway overhead")."""

from __future__ import annotations

import collections
import contextlib
import fcntl
import logging
import os
import pickle
import select
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PIPE_BYTES = 4 << 20
"""Pipe capacity asked for between a server and its producer process (Linux caps it at
``/proc/sys/fs/pipe-max-size``, 1 MiB by default for unprivileged processes)."""

FRAME = struct.Struct("!I")
"""Each item on the pipe to the producer process: its pickled length, then the pickle; length 0 ends."""


def enlarge_pipe(fd: int) -> int | None:
    """Linux: ask for ``PIPE_BYTES`` of pipe buffer, or the most an unprivileged process may have, so
    that a burst of records rarely finds the pipe full. Elsewhere the default size stays.
    Returns the pipe's capacity where the platform tells it."""
    if not hasattr(fcntl, "F_SETPIPE_SZ"):
        return None
    try:
        return fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except OSError:
        with contextlib.suppress(OSError, ValueError):
            limit = int(Path("/proc/sys/fs/pipe-max-size").read_text())
            return fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, min(limit, PIPE_BYTES))
    return None


class PipeWriter:
    """The parent's end of the pipe to the producer process, written from the caller's thread.

    A frame goes straight into the (enlarged, non-blocking) pipe when it has room, so a server's event
    loop pays one pickle and one ``write`` per call and no thread wakes up; only when the child falls
    behind do frames wait in a bounded backlog that a background thread writes out."""

    def __init__(self, conn: Any, max_buffered: int, max_buffered_bytes: int = 256 << 20) -> None:
        self.conn, self.fd, self.max_buffered = conn, conn.fileno(), max_buffered
        self.max_buffered_bytes = max_buffered_bytes
        """The backlog's bound in bytes as well as records: a record can carry a 100 KB body, so a bound
        in records alone lets the backlog of a stalled producer process grow to gigabytes."""
        self.backlog_bytes = 0
        os.set_blocking(self.fd, False)
        self.pipe_bytes = enlarge_pipe(self.fd)
        self.backlog: collections.deque[tuple[memoryview, int]] = collections.deque()
        self.backlog_items = 0
        self.waited = 0
        self.lost = 0
        self.closing = False
        self.lock = threading.Lock()
        """Taken as it is on the caller's path (a ``Condition``'s own ``with`` costs two Python calls more)."""
        self.cond = threading.Condition(self.lock)
        self.thread = threading.Thread(target=self._drain, name="streamrl-log-pipe", daemon=True)
        self.thread.start()

    def put(self, item: object, count: int) -> bool:
        """Pickle ``item`` (``count`` records) into a frame; False when the backlog is full (the caller
        counts the drop)."""
        return self.put_chunks((pickle.dumps(item, protocol=5),), count)

    def put_chunks(self, chunks: Sequence[bytes], count: int) -> bool:
        """One frame of ``chunks`` joined (``count`` records): written with one ``writev`` when the pipe has
        room, so the chunks are never joined in this process; False when the backlog is full."""
        size = sum(map(len, chunks))
        head = FRAME.pack(size)
        with self.lock:
            if self.closing:
                return False
            if self.backlog:  # the pipe may have room again: write what waits, not waiting for the drain thread
                self._flush_backlog()
                if self.backlog and (self.backlog_items >= self.max_buffered
                                     or self.backlog_bytes + FRAME.size + size > self.max_buffered_bytes):
                    return False
            written = 0
            if not self.backlog:  # nothing ahead of it: straight into the pipe
                try:
                    written = os.writev(self.fd, (head, *chunks))
                except BlockingIOError:
                    pass
                except OSError as exc:  # the child died: nothing will read this
                    self.lost += count
                    log.warning("records not handed to the producer process: %s", exc)
                    return True
                if written == FRAME.size + size:
                    return True
            frame = memoryview(b"".join((head, *chunks)))[written:]  # what the pipe did not take waits
            self.backlog.append((frame, count))
            self.backlog_items += count
            self.backlog_bytes += len(frame)
            self.waited += count
            self.cond.notify()
        return True

    def _flush_backlog(self) -> None:
        """Write waiting frames while the pipe takes them, without blocking (the lock held). When the
        child is gone, what waits is counted as lost."""
        while self.backlog:
            frame, n = self.backlog[0]
            try:
                rest = frame[os.write(self.fd, frame):]
            except BlockingIOError:
                return
            except OSError as exc:  # the child died: nothing will read these
                self.lost += self.backlog_items
                self.backlog.clear()
                self.backlog_items = self.backlog_bytes = 0
                log.warning("records not handed to the producer process: %s", exc)
                return
            self.backlog_bytes -= len(frame) - len(rest)
            if rest:
                self.backlog[0] = (rest, n)
                return
            self.backlog.popleft()
            self.backlog_items -= n

    @property
    def buffered(self) -> int:
        return self.backlog_items

    def _drain(self) -> None:
        while True:
            with self.cond:
                while not self.backlog and not self.closing:
                    self.cond.wait()
                if not self.backlog:
                    break
            select.select([], [self.fd], [])  # wait for room, the lock released
            with self.cond:
                self._flush_backlog()
        os.set_blocking(self.fd, True)
        with contextlib.suppress(OSError):
            os.write(self.fd, FRAME.pack(0))
        self.conn.close()

    def close(self, timeout_s: float) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify()
        self.thread.join(timeout_s)


class FrameReader:
    """The producer process's end of the pipe: a thread that empties the pipe into memory as fast as the
    parent fills it, so that whatever pauses the process's work (a slow record, kafka-python's sender
    holding the GIL, a collection) does not leave the pipe full (1 MiB where the kernel caps it, a few
    large records) and the server's records waiting in its backlog. Bounded in bytes:
    when ``max_bytes`` are waiting here it stops reading, and the parent's own bound takes over.

    While records flow it polls the pipe every ``poll_s`` instead of sleeping in ``read``: a write to a
    pipe with a sleeping reader wakes the reader with the kernel's "sync" hint, which puts it on the
    writer's CPU, where it preempts the server's event loop (figures in docs/gateway.md, "How it keeps
    overhead low"). After ``idle_s`` without data it sleeps in ``select`` again, so an idle server
    costs nothing; the first record after a pause wakes it."""

    def __init__(self, fd: int, max_bytes: int = 64 << 20, poll_s: float = 0.002, idle_s: float = 1.0) -> None:
        self.fd, self.max_bytes, self.poll_s, self.idle_s = fd, max_bytes, poll_s, idle_s
        self.pending_bytes = 0
        self.frames: collections.deque[bytes | None] = collections.deque()
        self.cond = threading.Condition()
        threading.Thread(target=self._read, name="streamrl-log-pipe-reader", daemon=True).start()

    def _chunks(self) -> Iterator[bytes]:
        """What the pipe holds, as it comes, until end of file."""
        os.set_blocking(self.fd, False)
        idle_since = None
        while True:
            try:
                chunk = os.read(self.fd, 1 << 20)
            except BlockingIOError:
                now = time.monotonic()
                idle_since = idle_since or now
                if now - idle_since < self.idle_s:
                    time.sleep(self.poll_s)
                else:
                    select.select([self.fd], [], [])
                continue
            if not chunk:
                return
            idle_since = None
            yield chunk

    def _read(self) -> None:
        buffer, pos = bytearray(), 0
        try:
            for chunk in self._chunks():
                buffer += chunk
                while len(buffer) - pos >= FRAME.size:
                    (size,) = FRAME.unpack_from(buffer, pos)
                    if not size:
                        return
                    if len(buffer) - pos - FRAME.size < size:
                        break
                    with memoryview(buffer) as view:  # one copy of the frame, not two
                        data = bytes(view[pos + FRAME.size:pos + FRAME.size + size])
                    pos += FRAME.size + size
                    with self.cond:
                        while self.pending_bytes >= self.max_bytes:
                            self.cond.wait()
                        self.frames.append(data)
                        self.pending_bytes += size
                        self.cond.notify_all()
                del buffer[:pos]
                pos = 0
        except OSError as exc:
            log.warning("reading the pipe from the server failed: %s", exc)
        finally:  # an empty frame, the parent gone or a read error: the end
            with self.cond:
                self.frames.append(None)
                self.cond.notify_all()

    def __iter__(self) -> Iterator[bytes]:
        while True:
            with self.cond:
                while not self.frames:
                    self.cond.wait()
                data = self.frames.popleft()
                if data is None:
                    return
                self.pending_bytes -= len(data)
                self.cond.notify_all()
            yield data
