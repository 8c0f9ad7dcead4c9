"""Several gateway processes on one port (``streamrl gateway --workers N``), to use a host's cores.

Each worker is a whole gateway of its own (its own gateway id on the coordination topic, its own Kafka
producer, its own spool directory ``<spool_dir>/worker-<i>``, kept across its restarts so that a worker
started again replays what its predecessor left), listening on its own socket bound with
``SO_REUSEPORT``: the kernel spreads incoming connections over the workers, no process in between. The
parent only starts them, restarts one that dies (after ``RESTART_PAUSE_S``), and stops them all on
SIGTERM/SIGINT. The workers agree on the policy version through the coordination log like gateways on
different hosts (docs/gateway.md, "Several gateways").
"""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from streamrl.child import stop_on_signals

from .config import GatewayConfig

log = logging.getLogger(__name__)

RESTART_PAUSE_S = 1.0
"""A worker that died is started again after this pause (a crash loop costs a core at most this often)."""


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` with ``SO_REUSEPORT``, so that every worker binds the same port;
    uvicorn listens on it (``Server.serve(sockets=[sock])``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(False)
    return sock


def worker_config(config: GatewayConfig, index: int) -> GatewayConfig:
    """Worker ``index``'s own config: one process, its own spool directory, its own id when one is given."""
    return dataclasses.replace(
        config, workers=1, spool_dir=str(config.spool_path / f"worker-{index}"),
        gateway_id=None if config.gateway_id is None else f"{config.gateway_id}-w{index}")


class Workers:
    """The parent of ``config.workers`` gateway processes sharing ``config.port``."""

    def __init__(self, config: GatewayConfig, work_dir: Path | None = None) -> None:
        if config.port == 0:
            raise ValueError("several gateway workers need a fixed port (not 0): each binds it itself")
        self.config = config
        self.work_dir = work_dir or Path(tempfile.mkdtemp(prefix="streamrl-gateway-workers-"))
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen | None] = [None] * config.workers
        self._stopping = threading.Event()

    def _command(self, index: int) -> list[str]:
        path = self.work_dir / f"worker-{index}.json"
        path.write_text(json.dumps(dataclasses.asdict(worker_config(self.config, index))))
        return [sys.executable, "-m", "streamrl.cli", "gateway", "--config", str(path), "--reuse-port"]

    def _start(self, index: int) -> None:
        self.procs[index] = subprocess.Popen(self._command(index))

    def run(self) -> int:
        """Start the workers and keep them running until SIGTERM/SIGINT; returns the exit status."""
        stop_on_signals(self._stopping)
        for i in range(self.config.workers):
            self._start(i)
        log.info("%d gateway workers on %s:%d", self.config.workers, self.config.host, self.config.port)
        while not self._stopping.wait(RESTART_PAUSE_S):
            for i, proc in enumerate(self.procs):
                if proc is not None and proc.poll() is not None:
                    log.warning("gateway worker %d exited with %s; starting it again", i, proc.returncode)
                    self._start(i)
        self.stop()
        return 0

    def stop(self, timeout_s: float = 30.0) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            if proc is not None:
                try:
                    proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
