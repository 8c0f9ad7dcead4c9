"""A TCP relay between the gateway and the session's real vLLM server, for tests that need an upstream
to misbehave on cue: go away and come back on the same port, answer late, hang up on a reused
connection, keep one request in flight until the test lets it finish, be slow to end a response, or lack a
route (a plain vLLM, which has no capture probe). Otherwise it only moves bytes; everything behind it is real."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading

from streamrl.broker.embedded import free_port

NOT_FOUND = (b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: 22\r\n"
             b"connection: close\r\n\r\n{\"detail\":\"Not Found\"}")
"""What vLLM's server (FastAPI) answers for a path it has no route for."""


class Relay:
    """A TCP relay on its own event loop thread: ``open()`` listens on a fixed port, ``close()`` stops
    listening and drops every connection, as a server that went away."""

    def __init__(self, target_port: int) -> None:
        self.port, self.target_port = free_port(), target_port
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server: asyncio.base_events.Server | None = None
        self.writers: set[asyncio.StreamWriter] = set()
        self.delay_s = 0.0
        """Hold each new connection this long before relaying it: an upstream that answers late."""
        self.answer_delay_s = 0.0
        """Hold the upstream's answer this long before passing it on: an upstream that is slow to reply."""
        self.hang_up_reused = False
        """Close a kept-alive connection, unanswered, when a second request arrives on it: a server
        closing an idle connection just as the client reuses it."""
        self.hold_marker: bytes | None = None
        """Hold back the answer to a request containing these bytes until ``release()``: a request that
        stays in flight for as long as the test needs, on any machine."""
        self.hold_after: bytes | None = None
        """Pass an answer on up to and including these bytes, then hold the rest until ``release()``: an
        upstream slow to end a response whose content it has sent."""
        self.not_found: tuple[str, ...] = ()
        """Answer a GET of one of these paths 404 itself (and close that connection), as a server without the
        route: ``(PROBE_PATH,)`` makes the engine behind look like a plain vLLM, without streamrl's capture."""
        self.holding = threading.Event()
        """Set once the relay holds something back: a request with ``hold_marker`` went upstream (its
        answer is now held), or an answer reached ``hold_after``."""
        self._released = asyncio.Event()
        self._shut: tuple[socket.socket, socket.socket] | None = None
        """While shut: the listening socket nobody accepts on, and the relay's own connection in its queue."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                        client: asyncio.StreamWriter, marked: asyncio.Event) -> None:
        """Client to upstream, hanging up on the client at a reused connection's next request."""
        requests = 0
        with contextlib.suppress(OSError, ConnectionError):
            while data := await reader.read(65536):
                if data.startswith((b"GET ", b"POST ")):
                    requests += 1
                    if data.startswith(tuple(f"GET {path} ".encode() for path in self.not_found)):
                        client.write(NOT_FOUND)
                        await client.drain()
                        client.close()
                        break
                    if requests > 1 and self.hang_up_reused:
                        client.close()
                        break
                if self.hold_marker is not None and self.hold_marker in data:  # before it goes upstream
                    marked.set()
                    self.holding.set()
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _answers(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                       marked: asyncio.Event) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while data := await reader.read(65536):
                if self.answer_delay_s:
                    await asyncio.sleep(self.answer_delay_s)
                if marked.is_set():
                    await self._released.wait()
                if self.hold_after is not None and self.hold_after in data:
                    end = data.index(self.hold_after) + len(self.hold_after)
                    self.holding.set()  # before the bytes go on: the client may act on them at once
                    writer.write(data[:end])
                    await writer.drain()
                    await self._released.wait()
                    data = data[end:]
                writer.write(data)
                await writer.drain()
        writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.writers |= {writer, up_writer}
        marked = asyncio.Event()
        await asyncio.gather(self._requests(reader, up_writer, writer, marked),
                             self._answers(up_reader, writer, marked))

    async def _open(self) -> None:
        if self._shut is not None:  # the shut socket goes on listening: connections waiting on it get through
            listening, filler = self._shut
            self._shut = None
            listening.accept()[0].close()
            filler.close()
            self.server = await asyncio.start_server(self._handle, sock=listening)
            return
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", self.port, reuse_address=True)

    async def _close(self) -> None:
        assert self.server is not None
        self.server.close()
        for w in self.writers:
            w.close()
        self.writers.clear()
        await self.server.wait_closed()

    def open(self) -> None:
        asyncio.run_coroutine_threadsafe(self._open(), self.loop).result(10)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self.loop).result(10)

    def shut(self) -> None:
        """Take no connection, without refusing any, until ``open()``: the relayed connections are dropped and the
        port listens with a queue of one place, which a connection of the relay's own takes, so that a new
        connection's SYN is dropped and its connect hangs, as on a host too busy to accept or when a SYN is
        lost. (Linux drops a SYN while the listen queue is full.)"""
        self.close()
        listening = socket.socket()
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listening.bind(("127.0.0.1", self.port))
        listening.listen(0)
        self._shut = listening, socket.create_connection(("127.0.0.1", self.port), timeout=5)

    def release(self) -> None:
        """Let the held answers through (and any later one)."""
        self.loop.call_soon_threadsafe(self._released.set)

    def hold_again(self) -> None:
        """After ``release``: hold the next answers again, as before the first."""
        async def clear() -> None:
            self._released.clear()
        asyncio.run_coroutine_threadsafe(clear(), self.loop).result(10)
        self.holding.clear()

    def stop(self) -> None:
        for sock in self._shut or ():
            sock.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
