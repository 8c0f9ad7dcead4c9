"""Run a gateway inside the current process on a background thread (tests, benchmarks, ``streamrl up``)."""

from __future__ import annotations

import logging
import threading
import time

import uvicorn

from .app import create_app
from .cli import uvicorn_config
from .config import GatewayConfig

log = logging.getLogger(__name__)


class GatewayServer:
    """``with GatewayServer(config) as gw: gw.url ...``; the gateway's parts are at ``gw.gateway``."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.app = create_app(config)
        self.gateway = self.app.state.gateway
        self._server = uvicorn.Server(uvicorn_config(self.app, config))
        self._thread = threading.Thread(target=self._server.run, name="gateway", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.config.port}"

    def start(self, timeout: float = 60.0) -> GatewayServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()  # (one still starting stops once started: nothing is left running)
                raise RuntimeError("gateway did not start")
            time.sleep(0.01)
        return self

    @property
    def running(self) -> bool:
        """Its server thread has not ended (started, or still stopping)."""
        return self._thread.is_alive()

    def stop(self, timeout_s: float = 60.0) -> None:
        """Ask the server to exit, and wait for it (its producers deliver what they hold first)."""
        self._server.should_exit = True
        self._thread.join(timeout=timeout_s)
        if self.running:
            log.warning("gateway at %s still stopping after %.0fs", self.url, timeout_s)

    def __enter__(self) -> GatewayServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
