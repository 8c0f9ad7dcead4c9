"""Child processes: start one in its own process group, wait until it is ready, stop it and its children.

The engine (vLLM and the workers it spawns), the embedded broker and ``streamrl up``'s gateway and trainer
are all children of some streamrl process; this module is the one way they are started and stopped, so
that a stop always reaches a child's own children and never leaves one behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx


def spawn(argv: list[str], *, env: dict[str, str] | None = None, log: Path | None = None,
          pipe: bool = False) -> subprocess.Popen:
    """Start ``argv`` in a new process group (so a stop reaches what it spawns), stdin closed, output
    appended to ``log``, or readable from ``.stdout`` with ``pipe``, or dropped."""
    out = open(log, "ab") if log is not None else subprocess.PIPE if pipe else subprocess.DEVNULL  # noqa: SIM115
    try:
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    finally:
        if log is not None:
            out.close()  # the child holds its own copy


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to a child's process group (it and what it spawned); a group already gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def stop_group(proc: subprocess.Popen, timeout: float) -> bool:
    """SIGTERM a child's process group, SIGKILL what is left after ``timeout``. True if it had to be killed."""
    killed = False
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            killed = True
    with contextlib.suppress(ProcessLookupError):  # stragglers of an exited leader
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return killed


def wait_http(base_url: str, timeout: float, proc: subprocess.Popen | None = None, *,
              what: str = "server", interval: float = 0.2, path: str = "/health") -> None:
    """Wait until ``GET base_url + path`` answers 200; raise early if ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{what} exited with code {proc.returncode} during start-up")
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{base_url}{path}").status_code == 200:
                    return
            time.sleep(interval)
    raise TimeoutError(f"{what} not healthy after {timeout}s")


def wait_port(host: str, port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Wait until something accepts TCP connections on host:port; raise early if ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {host}:{port}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
            return
        time.sleep(0.02)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout}s")


def stop_on_signals(stop: threading.Event) -> None:
    """SIGTERM and SIGINT set ``stop`` (from the main thread): how every streamrl command is told to finish
    what it is doing and exit 0, by ``streamrl up``, a supervisor, or Ctrl-C."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())


def serve_until_stopped(proc: subprocess.Popen | None, stop: threading.Event) -> bool:
    """Wait until ``stop`` is set (True) or the child ``proc`` exits by itself (False): the foreground
    loop of a command whose work is done by one child (``streamrl broker``, ``streamrl engine``)."""
    while not stop.wait(1.0):
        if proc is not None and proc.poll() is not None:
            return False
    return True
