"""Starting the real services the tests run against: a vLLM server, a gateway in front of it (the
session fixtures in ``tests/conftest.py`` use these, and so do tests that need one of their own), and where
their logs go."""

from __future__ import annotations

import os
from pathlib import Path

import httpx

from streamrl.broker.embedded import EmbeddedBroker, free_port
from streamrl.engine.server import Engine, EngineConfig
from streamrl.gateway.config import GatewayConfig
from streamrl.gateway.server import GatewayServer

LOG_DIR = Path(os.environ.get("STREAMRL_TEST_LOGS", "/tmp/streamrl-test-logs"))


def start_engine(model: Path, name: str, *, token_capture: bool = True) -> Engine:
    """``token_capture=False``: a plain vLLM server, without streamrl's capture middleware."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    return Engine(EngineConfig(model=str(model), max_loras=4, max_model_len=1024, token_capture=token_capture),
                  log_file=LOG_DIR / f"{name}.log").start(timeout=600)


def start_gateway(broker: EmbeddedBroker, engine: Engine, token_capture: bool,
                  deferred_capture: bool = True) -> GatewayServer:
    """A gateway in front of ``engine`` logging to the session broker's topics (no policy following: other
    tests publish versions there), checked to take tokens the way ``token_capture`` and ``deferred_capture``
    say."""
    config = GatewayConfig(upstreams=(engine.url,), bootstrap_servers=broker.bootstrap_servers,
                           port=free_port(), topic_prefix=broker.topics.prefix, max_body_bytes=64 << 10,
                           health_interval_s=0.5, follow_policy=False, token_capture=token_capture,
                           deferred_capture=deferred_capture)
    gw = GatewayServer(config).start()
    try:
        assert gw.gateway.producer.wait_ready(0)  # it serves once its producer process reads the pipe
        path = httpx.get(f"{gw.url}/health").json()["upstreams"][0]["token_capture"]
        assert path == ("json" if not token_capture else "engine, deferred" if deferred_capture else "engine")
    except BaseException:
        gw.stop()
        raise
    return gw
