"""What the hot-swap tests ask of the real engine: the adapters it lists, and how often it loaded one."""

from __future__ import annotations

import time

import httpx

from streamrl.engine.server import Engine


def engine_adapters(engine: Engine) -> set[str]:
    return {m["id"] for m in httpx.get(f"{engine.url}/v1/models").json()["data"] if m.get("parent")}


def wait_unloaded(engine: Engine, name: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while name in engine_adapters(engine):
        assert time.monotonic() < deadline, f"{name} still loaded"
        time.sleep(0.05)


def engine_loads(engine: Engine, name: str) -> int:
    """How many times the engine itself loaded the adapter ``name``, read from its log: vLLM logs each
    load it performs (a refused second load of a loaded name is not one), flushed line by line."""
    assert engine.log_file is not None
    return engine.log_file.read_text(errors="replace").count(f"Loaded new LoRA adapter: name '{name}'")
