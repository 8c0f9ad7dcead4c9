"""Adapters' host copies in pageable memory (``engine/lora_memory.py``): what the worker extension
does on import, and that ``streamrl engine`` names it. The engine tests load adapters into real vLLM servers
started with it (tests/integration/test_hotswap.py, tests/integration/test_trainer.py); what it is for, a load
beside a GPU neighbour, is measured on the H200 (bench/lora_pin_bench.py, bench/lora_load_bench.py)."""

from __future__ import annotations

import pytest
import vllm
from vllm.lora import lora_model, model_manager

from streamrl.engine import lora_memory as vllm_lora_memory
from streamrl.engine.server import Engine, EngineConfig

EXTENSION = "streamrl.engine.worker.StreamrlWorkerExtension"


def test_importing_the_extension_keeps_adapters_pageable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lora_model, "PIN_MEMORY", True)
    monkeypatch.setattr(model_manager, "PIN_MEMORY", True)
    assert vllm_lora_memory.pageable_lora_host_memory()  # the installed vLLM is a tested one
    assert lora_model.PIN_MEMORY is False and model_manager.PIN_MEMORY is False


def test_an_untested_vllm_is_left_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    monkeypatch.setattr(lora_model, "PIN_MEMORY", True)
    monkeypatch.setattr(model_manager, "PIN_MEMORY", True)
    assert not vllm_lora_memory.pageable_lora_host_memory()
    assert lora_model.PIN_MEMORY is True and model_manager.PIN_MEMORY is True


def test_the_engines_worker_keeps_adapters_pageable(engine: Engine) -> None:
    """The real vLLM (CPU build) imported the extension in its worker's process, before any adapter loads."""
    assert engine.log_file is not None
    assert "adapters' host copies stay in pageable memory in this process" in engine.log_file.read_text()


def test_the_engine_names_the_extension_and_says_whether_to_pin() -> None:
    """The worker extension (``engine/worker.py``) keeps adapters pageable unless the engine's environment says
    to pin, and carries in-flight updates' worker half, so an engine with token capture always names it."""
    from streamrl.engine.worker_env import PIN_ENV

    def extension(config: EngineConfig) -> tuple[str | None, str]:
        engine = Engine(config)
        cmd = engine.command()
        named = cmd[cmd.index("--worker-extension-cls") + 1] if "--worker-extension-cls" in cmd else None
        return named, engine.environment()[PIN_ENV]

    assert extension(EngineConfig(model="m")) == (EXTENSION, "0")
    assert extension(EngineConfig(model="m", pin_lora_memory=True)) == (EXTENSION, "1")
    assert extension(EngineConfig(model="m", pin_lora_memory=True, token_capture=False)) == (None, "1")
