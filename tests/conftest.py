"""Session-wide real services for the tests: the embedded broker, a tiny model built here, and a vLLM
server (CPU build) on it. Each starts once per test session, on free ports."""

from __future__ import annotations

import contextlib
import getpass
import multiprocessing
import os
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.kafka_reader import TopicReader
from support.relay import Relay
from support.services import LOG_DIR, start_engine, start_gateway, warm_up

from streamrl.broker.embedded import EmbeddedBroker
from streamrl.broker.topics import Topics, create_topics
from streamrl.engine.server import Engine
from streamrl.gateway.server import GatewayServer
from streamrl.tiny_model import build_model, random_adapter

INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"


@pytest.fixture(scope="session", autouse=True)
def own_temp_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """In-process parts' temp files (a gateway's default spool, ``<temp dir>/streamrl-spool-<port>``) under
    this session's own directory: a spool an earlier run left on a port used again is never replayed
    into this run's topics.

    torch's inductor cache stays where it is outside the tests (``<system temp>/torchinductor_<user>``):
    torch puts the directory it picks into ``TORCHINDUCTOR_CACHE_DIR`` the first time it needs it (building
    the tiny model does), every vLLM server and trainer started afterwards inherits it, and under this
    session's own temp dir it was empty in every session, so each fresh vLLM compiled its CPU kernels again
    on its first sampled request (about 10 s of g++ a server). The cache is keyed by the code it compiles."""
    old, old_cache = tempfile.tempdir, os.environ.get(INDUCTOR_CACHE)
    os.environ.setdefault(INDUCTOR_CACHE, os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"))
    tempfile.tempdir = str(tmp_path_factory.mktemp("tmp"))
    yield
    tempfile.tempdir = old
    if old_cache is None:
        os.environ.pop(INDUCTOR_CACHE, None)
    else:
        os.environ[INDUCTOR_CACHE] = old_cache


@pytest.fixture(scope="session", autouse=True)
def nothing_left_running() -> Iterator[None]:
    """After the last test: no gateway thread and no record producer process of this session still runs. One
    left over is a test (or a shutdown) that did not stop what it started, and once made CI wait forever."""
    yield
    left = [p.name for p in multiprocessing.active_children() if p.name == "streamrl-log-producer"]
    left += [t.name for t in threading.enumerate() if t.name == "gateway"]
    assert not left, f"still running after the tests: {left}"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Qwen2 with a local BPE tokenizer (vocab 2048) and a chat template."""
    return build_model(tmp_path_factory.mktemp("tiny-model"), "tiny", seed=0)


@pytest.fixture(scope="session")
def broker() -> Iterator[EmbeddedBroker]:
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    b = EmbeddedBroker(topics=Topics("test"), partitions=2, log_file=LOG_DIR / "broker.log").start()
    yield b
    b.stop()


@pytest.fixture(scope="session")
def engine(tiny_model: Path, own_temp_dir: None) -> Iterator[Engine]:
    """A real vLLM OpenAI server on the tiny model, shared by all tests of the session, warmed up (its first
    request with logprobs makes vLLM's CPU kernels: done here, not in the first test that uses it). Started when a
    test first needs it, not in the background: beside the tests that start vLLM servers of their own, a session
    engine starting on the 2-core machine slowed them by more than it saved (test_e2e 41 -> 97 s)."""
    e = start_engine(tiny_model, "vllm-0")
    warm_up(e).join(180)
    yield e
    e.stop()


@pytest.fixture(scope="module")
def base_model(engine: Engine) -> str:
    """The name the engine serves its base model under (module scope: a module may override ``engine``)."""
    return httpx.get(f"{engine.url}/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> list[Path]:
    """Random LoRA adapters of the tiny model, versions 1..``ADAPTER_VERSIONS`` of the module (default 4)."""
    root = tmp_path_factory.mktemp("adapters")
    versions = getattr(request.module, "ADAPTER_VERSIONS", 4)
    return [random_adapter(tiny_model, root / f"v{v}", seed=v) for v in range(1, versions + 1)]


@pytest.fixture(scope="module")
def topics(broker: EmbeddedBroker, request: pytest.FixtureRequest) -> Topics:
    """The module's own ``TOPICS``, created on the session broker (two partitions each)."""
    module_topics: Topics = request.module.TOPICS
    create_topics(broker.bootstrap_servers, module_topics, partitions=2)
    return module_topics


@pytest.fixture(scope="module")
def engine_gateway(broker: EmbeddedBroker, engine: Engine) -> Iterator[GatewayServer]:
    """Tokens from the engine's capture (``streamrl engine``'s own path): non-streamed calls' captures on the
    engine's capture stream to the producer (deferred), streamed calls' framed in the answer
    (``test_engine_capture.py`` runs its tests with every call framed too)."""
    gw = start_gateway(broker, engine, token_capture=True)
    yield gw
    gw.stop()


@pytest.fixture
def log_topics(broker: EmbeddedBroker) -> Topics:
    """The topics ``completions`` and ``rewards`` read: the session broker's (a module logging to topics of
    its own overrides this fixture)."""
    return broker.topics


@pytest.fixture
def completions(broker: EmbeddedBroker, log_topics: Topics) -> Iterator[TopicReader]:
    """The completions topic, read from its end."""
    reader = TopicReader(broker.bootstrap_servers, log_topics.completions)
    yield reader
    reader.close()


@pytest.fixture
def rewards(broker: EmbeddedBroker, log_topics: Topics) -> Iterator[TopicReader]:
    """The rewards topic, read from its end."""
    reader = TopicReader(broker.bootstrap_servers, log_topics.rewards)
    yield reader
    reader.close()


@pytest.fixture
def relay(engine: Engine) -> Iterator[Relay]:
    """A TCP relay in front of the session's engine (``support/relay.py``), open, closed after the test."""
    r = Relay(engine.port)
    r.open()
    yield r
    r.release()
    with contextlib.suppress(Exception):
        r.close()
    r.stop()
