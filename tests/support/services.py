"""Starting the real services the tests run against: a vLLM server, a gateway in front of it (the
session fixtures in ``tests/conftest.py`` use these, and so do tests that need one of their own), and where
their logs go."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

import httpx

from streamrl.broker.embedded import EmbeddedBroker, free_port
from streamrl.child import wait_http
from streamrl.engine.server import Engine, EngineConfig
from streamrl.gateway.config import GatewayConfig, GatewayKafka
from streamrl.gateway.server import GatewayServer

LOG_DIR = Path(os.environ.get("STREAMRL_TEST_LOGS", "/tmp/streamrl-test-logs"))
ENGINE_START_S = 600


def start_engine(model: Path, name: str, *, token_capture: bool = True, wait: bool = True) -> Engine:
    """``token_capture=False``: a plain vLLM server, without streamrl's capture middleware. ``wait=False``: only
    launched (it starts while other work goes on); ``engine.wait_healthy(ENGINE_START_S)`` before using it."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    engine = Engine(EngineConfig(model=str(model), max_loras=6, max_model_len=1024, token_capture=token_capture),
                    log_file=LOG_DIR / f"{name}.log")
    return engine.start(timeout=ENGINE_START_S) if wait else engine.launch()


def warm_up(engine: Engine) -> threading.Thread:
    """A thread that waits for the launched ``engine`` and sends it one sampled request with logprobs: vLLM's CPU
    build makes its logprob kernels on the first such request (3 s here with torch's inductor cache warm, more
    without); started right after the launch, that happens while other tests run. Best effort: whatever fails
    here fails again, and is reported, in the first test that uses the engine."""

    def run() -> None:
        with contextlib.suppress(Exception):
            wait_http(engine.url, ENGINE_START_S, engine.proc, what="vLLM")
            httpx.post(f"{engine.url}/v1/chat/completions", timeout=120, json={
                "model": engine.config.model, "messages": [{"role": "user", "content": "warm up"}], "max_tokens": 2,
                "logprobs": True, "return_token_ids": True})

    thread = threading.Thread(target=run, name="engine-warm-up", daemon=True)
    thread.start()
    return thread


def start_gateway(broker: EmbeddedBroker, engine: Engine, token_capture: bool,
                  deferred_capture: bool = True) -> GatewayServer:
    """A gateway in front of ``engine`` logging to the session broker's topics (no policy following: other
    tests publish versions there), checked to take tokens the way ``token_capture`` and ``deferred_capture``
    say."""
    config = GatewayConfig(upstreams=(engine.url,),
                           kafka=GatewayKafka(bootstrap_servers=broker.bootstrap_servers,
                                              topic_prefix=broker.topics.prefix),
                           port=free_port(), max_body_bytes=64 << 10,
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
