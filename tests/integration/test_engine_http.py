"""The HTTP server of the engine ``streamrl engine`` starts (vLLM's uvicorn), as its clients see it."""

from __future__ import annotations

import http.client
import time
from urllib.parse import urlsplit

from streamrl.engine.server import KEEP_ALIVE_S, Engine


def test_idle_connection_outlives_vllms_default_keep_alive(engine: Engine) -> None:
    """A kept-alive connection left idle for longer than vLLM's default 5 s still carries the next request
    (``KEEP_ALIVE_S``: with 5 s, a client that could not run for a while lost its next requests). The idle time is what
    is tested, so the test waits it out."""
    assert KEEP_ALIVE_S > 6
    url = urlsplit(engine.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        conn.request("GET", "/health")
        first = conn.getresponse()
        first.read()
        assert first.status == 200
        sock = conn.sock
        time.sleep(6)
        conn.request("GET", "/v1/models")
        second = conn.getresponse()
        assert second.status == 200 and b'"data"' in second.read()
        assert conn.sock is sock  # the same connection, not a new one
    finally:
        conn.close()


def test_engine_core_gives_way_to_the_api_server_on_the_cpu(engine: Engine) -> None:
    """On a CPU-only machine the engine core runs nicer than the API server (``engine/core_priority.py``): its
    busy-waiting on the worker otherwise starved the API server for seconds while a request ran."""
    import psutil

    server = psutil.Process(engine.proc.pid)
    cores = [p for p in server.children(recursive=True) if "EngineCore" in " ".join(p.cmdline()) + p.name()]
    assert len(cores) == 1, [(p.name(), p.cmdline()) for p in server.children(recursive=True)]
    assert server.nice() == 0 and cores[0].nice() == 10, (server.nice(), cores[0].nice())
