"""A TCP relay for tests that must keep a request in flight for as long as they need, whatever the speed
of the machine: it passes bytes both ways between the gateway and a real server, except that the answer
to a request containing a marker is held back until the test releases it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from urllib.parse import urlsplit


class HoldingRelay:
    def __init__(self, target_url: str, marker: bytes) -> None:
        target = urlsplit(target_url)
        self._target = (target.hostname or "127.0.0.1", target.port or 80)
        self._marker = marker
        self.holding = threading.Event()
        """Set once a marked request has been passed on (its answer is now held)."""
        self._loop = asyncio.new_event_loop()
        self._released = asyncio.Event()
        self._thread = threading.Thread(target=self._loop.run_forever, name="holding-relay", daemon=True)
        self._server: asyncio.Server | None = None
        self.url = ""

    def __enter__(self) -> HoldingRelay:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self._loop).result(10)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    def release(self) -> None:
        """Let every held answer through (and those of later marked requests)."""
        self._loop.call_soon_threadsafe(self._released.set)

    def __exit__(self, *exc: object) -> None:
        self.release()

        async def close() -> None:
            assert self._server is not None
            self._server.close()
            for task in asyncio.all_tasks() - {asyncio.current_task()}:
                task.cancel()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(*self._target)
        except OSError:
            client_w.close()
            return
        marked = asyncio.Event()
        await asyncio.gather(self._pump(client_r, server_w, marked, upstream=True),
                             self._pump(server_r, client_w, marked, upstream=False), return_exceptions=True)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, marked: asyncio.Event,
                    upstream: bool) -> None:
        tail = b""
        try:
            while data := await reader.read(65536):
                if upstream and not marked.is_set():
                    if self._marker in tail + data:  # marked before it is passed on: no answer can slip by
                        marked.set()
                        self.holding.set()
                    tail = data[-len(self._marker):]
                if not upstream and marked.is_set():
                    await self._released.wait()
                writer.write(data)
                await writer.drain()
        finally:
            with contextlib.suppress(Exception):
                writer.close()
