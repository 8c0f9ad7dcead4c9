"""How a learner out of process acknowledges a batch of ``streamrl batches``: a file it renames into place,
or an HTTP call (``--ack-port``).

Both channels end in the same record, the ack file ``{"seq": N, "version": V}`` that the stream reads on
start to learn which batch the learner holds. Over HTTP the stream writes that file itself, durably, before
it acknowledges the batch to its own log and answers 200, exactly as a learner's rename would have left it:
so a restart of either side finds the same state whichever channel was used, and the two give the same
exactly-once guarantee (docs/trainer.md, "Out of process").

The HTTP server is the standard library's: ``streamrl batches`` is a blocking loop with no event loop to
host an ASGI app, and two small routes do not justify one (the trainer's metrics port is served the same
way, by ``prometheus_client``'s threaded ``http.server``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from socket import AF_INET6
from typing import Any
from urllib.parse import urlsplit

from .feed_state import write_ack_file

log = logging.getLogger("streamrl.batches")

ACK_POLL_S = 0.05
"""How often the acknowledgement file is looked at while a batch is out (and a stop is noticed)."""

MAX_BODY_BYTES = 4096
"""An acknowledgement is a few dozen bytes; a larger body is refused unread."""

Answer = tuple[int, dict[str, Any]]
"""An HTTP status and its JSON body."""


def read_ack(path: Path) -> tuple[int, int] | None:
    """(seq, version) of the learner's last acknowledgement, or None before the first."""
    try:
        ack = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    return int(ack["seq"]), int(ack["version"])


def write_ack(path: Path, seq: int, version: int) -> None:
    """The ack file as a learner writes it, durably: after this returns, a restart of the stream finds it."""
    write_ack_file(path, seq, version)


class FileAcks:
    """The learner renames ``{"seq": N, "version": V}`` into ``path``; the stream polls it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def last(self) -> tuple[int, int] | None:
        """The learner's last acknowledgement on record: (seq, version), or None."""
        return read_ack(self.path)

    def expect(self, seq: int, version: int) -> None:
        """Batch ``seq`` is about to be handed out; the stream's version acknowledged last is ``version``."""

    def wait(self, seq: int, stop: threading.Event) -> int | None:
        """The version the learner acknowledged batch ``seq`` with, once it has (and it is on record); None
        when ``stop`` is set first."""
        while not stop.is_set():
            got = read_ack(self.path)
            if got is not None and got[0] >= seq:
                return got[1]
            time.sleep(ACK_POLL_S)
        return None

    def settled(self, seq: int, error: str | None = None) -> None:
        """The stream has acknowledged batch ``seq`` to its own log (or failed to: ``error``)."""

    def close(self) -> None:
        """Stop taking acknowledgements."""


class HttpAcks(FileAcks):
    """``POST /ack`` with ``{"seq": N, "adapter_version": V}``, answered once the acknowledgement is durable;
    ``GET /health`` says which batch awaits one. One acknowledgement is handled at a time."""

    def __init__(self, path: Path, host: str, port: int) -> None:
        super().__init__(path)
        self.acked = self.last()
        """(seq, version) acknowledged last, as on record."""
        self.out: int | None = None
        """The batch handed out and awaiting its acknowledgement."""
        self.floor = 0
        """The stream's own version acknowledged last: an acknowledgement may not go below it either."""
        self._cond = threading.Condition()
        self._posted: tuple[int, int] | None = None
        self._answer: Answer | None = None
        self._one = threading.Lock()
        self._closing = False
        self.server = _AckServer((host, port), self)
        bound = self.server.server_address[1]
        self.url = f"http://[{host}]:{bound}" if ":" in host else f"http://{host}:{bound}"
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.1,), name="streamrl-batches-ack",
                                        daemon=True)  # (0.1 s: how soon a shutdown is noticed)
        self._thread.start()
        log.info("acknowledgements: POST %s/ack {\"seq\": N, \"adapter_version\": V}", self.url)

    def expect(self, seq: int, version: int) -> None:
        with self._cond:
            self.out, self.floor = seq, version

    def wait(self, seq: int, stop: threading.Event) -> int | None:
        with self._cond:
            while not self._cond.wait_for(lambda: self._posted is not None, timeout=ACK_POLL_S):
                if stop.is_set():
                    return None
            assert self._posted is not None and self._posted[0] == seq, (self._posted, seq)
            version = self._posted[1]
        write_ack(self.path, seq, version)  # the file channel's record, so that a restart reads it alike
        return version

    def settled(self, seq: int, error: str | None = None) -> None:
        with self._cond:
            if self._posted is None:
                return
            version = self._posted[1]
            if error is None:
                self.acked, self.out = (seq, version), None
                self._answer = HTTPStatus.OK, {"seq": seq, "adapter_version": version, "already": False}
            else:
                self._answer = HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"batch {seq} not acknowledged: {error}"}
            self._posted = None
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self.server.shutdown()
        self.server.server_close()  # waits for the handlers, released above

    def health(self) -> dict[str, Any]:
        with self._cond:
            acked = None if self.acked is None else {"seq": self.acked[0], "adapter_version": self.acked[1]}
            return {"status": "ok", "awaiting": self.out, "acknowledged": acked}

    def post(self, body: bytes) -> Answer:
        """One acknowledgement: refused (4xx) unless it is well formed and names the batch awaiting one (or
        repeats the last one, answered at once: a retry after a lost answer), else 200 once durable."""
        parsed = parse_ack(body)
        if isinstance(parsed, str):
            return HTTPStatus.BAD_REQUEST, {"error": parsed}
        seq, version = parsed
        with self._one, self._cond:
            refused = self._check(seq, version)
            if refused is not None:
                return refused
            self._posted, self._answer = (seq, version), None
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._answer is not None or self._closing)
            if self._answer is None:
                self._posted = None
                return HTTPStatus.SERVICE_UNAVAILABLE, {
                    "error": f"the stream is stopping: batch {seq} was not acknowledged; send it again once "
                             "it has restarted (it hands the batch out again)"}
            answer, self._answer = self._answer, None
            return answer

    def _check(self, seq: int, version: int) -> Answer | None:
        """Why ``(seq, version)`` cannot be taken now (a 409), the answer to a repeat, or None: it can."""
        acked_seq, acked_version = self.acked or (0, 0)
        if self.acked is not None and seq == acked_seq:
            if version == acked_version:
                return HTTPStatus.OK, {"seq": seq, "adapter_version": version, "already": True}
            return HTTPStatus.CONFLICT, {
                "error": f"batch {seq} is already acknowledged at version {acked_version}, not {version}"}
        if seq < acked_seq:
            return HTTPStatus.CONFLICT, {
                "error": f"batch {seq} is older than batch {acked_seq}, acknowledged already at version "
                         f"{acked_version}: acknowledge the batch trained last (is the learner's checkpoint "
                         "older than its acknowledgements?)"}
        if self.out is None or seq > self.out:
            newest = self.out if self.out is not None else acked_seq
            return HTTPStatus.CONFLICT, {
                "error": f"batch {seq} has not been handed out (the newest is batch {newest})"}
        if seq != self.out:
            return HTTPStatus.CONFLICT, {"error": f"batch {seq} is not the one awaiting acknowledgement (batch "
                                                  f"{self.out})"}
        if version < max(acked_version, self.floor):
            return HTTPStatus.CONFLICT, {
                "error": f"version {version} goes backwards: the learner's version acknowledged last is "
                         f"{max(acked_version, self.floor)}"}
        return None


def parse_ack(body: bytes) -> tuple[int, int] | str:
    """``{"seq": N, "adapter_version": V}`` (``"version"``, the ack file's name, is taken too) as (N, V), or
    what is wrong with it."""
    try:
        ack = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        return f"the body is not JSON ({exc}): send {{\"seq\": N, \"adapter_version\": V}}"
    if not isinstance(ack, dict):
        return "the body must be a JSON object: {\"seq\": N, \"adapter_version\": V}"
    extra = set(ack) - {"seq", "adapter_version", "version"}
    if extra:
        return f"unknown fields {sorted(extra)}: send {{\"seq\": N, \"adapter_version\": V}}"
    if "adapter_version" in ack and "version" in ack and ack["adapter_version"] != ack["version"]:
        return "adapter_version and version disagree: send one"
    seq, version = ack.get("seq"), ack.get("adapter_version", ack.get("version"))
    for name, value, least in (("seq", seq, 1), ("adapter_version", version, 0)):
        if value is None:
            return f"{name} is missing: send {{\"seq\": N, \"adapter_version\": V}}"
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            return f"{name} must be an integer >= {least}, not {value!r}"
    assert isinstance(seq, int) and isinstance(version, int)
    return seq, version


class _AckServer(ThreadingHTTPServer):
    """The standard library's threaded server; ``server_close`` joins its handler threads."""

    def __init__(self, address: tuple[str, int], acks: HttpAcks) -> None:
        if ":" in address[0]:
            self.address_family = AF_INET6
        self.acks = acks
        super().__init__(address, _AckHandler)


class _AckHandler(BaseHTTPRequestHandler):
    server: _AckServer
    server_version = "streamrl-batches"
    timeout = 10
    """Seconds a connection may sit silent: a stuck client cannot hold up a shutdown longer."""

    def do_POST(self) -> None:
        route = urlsplit(self.path).path
        if route != "/ack":
            return self._send(*self._elsewhere(route))
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            return self._send(HTTPStatus.BAD_REQUEST, {"error": "Content-Length is not a number"})
        if length > MAX_BODY_BYTES:
            self.close_connection = True
            return self._send(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                              {"error": f"an acknowledgement is at most {MAX_BODY_BYTES} bytes"})
        self._send(*self.server.acks.post(self.rfile.read(length)))

    def do_GET(self) -> None:
        route = urlsplit(self.path).path
        self._send(*((HTTPStatus.OK, self.server.acks.health()) if route == "/health" else self._elsewhere(route)))

    def _elsewhere(self, route: str) -> Answer:
        if route in ("/ack", "/health"):
            return HTTPStatus.METHOD_NOT_ALLOWED, {"error": "POST /ack, GET /health"}
        return HTTPStatus.NOT_FOUND, {"error": f"no route {route}: POST /ack, GET /health"}

    def _send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status == HTTPStatus.METHOD_NOT_ALLOWED:
            self.send_header("Allow", "POST" if urlsplit(self.path).path == "/ack" else "GET")
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)
