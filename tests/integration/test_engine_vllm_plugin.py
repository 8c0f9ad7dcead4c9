"""streamrl's vLLM plugin (``engine/vllm_hooks.py``): the worker's hooks, installed by vLLM itself through the
``vllm.general_plugins`` entry point in the processes of an engine ``streamrl engine`` started. The engine tests
load adapters into and move requests inside real vLLM servers started so (tests/integration/test_hotswap.py,
test_engine_inflight.py); what pageable adapters are for, a load beside a GPU neighbour, is measured on the GPU
(bench/lora_pin_bench.py, bench/lora_load_bench.py)."""

from __future__ import annotations

import pytest
import vllm
from vllm.lora import lora_model, model_manager

from streamrl.engine import vllm_hooks
from streamrl.engine.server import Engine


def test_pageable_adapters_on_a_tested_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lora_model, "PIN_MEMORY", True)
    monkeypatch.setattr(model_manager, "PIN_MEMORY", True)
    assert vllm_hooks.pageable_lora_host_memory()  # the installed vLLM is a tested one
    assert lora_model.PIN_MEMORY is False and model_manager.PIN_MEMORY is False


def test_an_untested_vllm_is_left_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    monkeypatch.setattr(lora_model, "PIN_MEMORY", True)
    monkeypatch.setattr(model_manager, "PIN_MEMORY", True)
    assert not vllm_hooks.pageable_lora_host_memory()
    assert lora_model.PIN_MEMORY is True and model_manager.PIN_MEMORY is True
    assert isinstance(vllm_hooks.hook_output_processor(object(), lambda processor: None), str)


def test_the_runners_apply_a_steps_moves_once_wrapped(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wrapped method hands the step's moves to ``apply`` first, then runs vLLM's own; wrapping twice (the
    plugin runs in every process vLLM starts, a uniprocess engine core is also its worker) wraps once."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from streamrl.engine.inflight import MOVES_KEY

    calls: list[object] = []
    monkeypatch.setattr(GPUModelRunner, "_update_states", lambda self, out: calls.append(("vllm", out)))
    monkeypatch.setattr(vllm_hooks, "_wrapped_runners", set())
    apply = lambda runner, moves: calls.append(("apply", moves))  # noqa: E731
    assert vllm_hooks.wrap_model_runners(apply) and vllm_hooks.wrap_model_runners(apply)

    class Step:
        pass

    step, quiet = Step(), Step()
    setattr(step, MOVES_KEY, {"r1": "lora"})
    GPUModelRunner._update_states(object(), step)
    GPUModelRunner._update_states(object(), quiet)
    assert calls == [("apply", {"r1": "lora"}), ("vllm", step), ("vllm", quiet)]


def test_the_plugin_ran_in_the_engines_worker(engine: Engine) -> None:
    """The real vLLM (CPU build) loaded the plugin through its entry point and it installed both worker hooks,
    before any adapter loaded."""
    assert engine.log_file is not None
    log = engine.log_file.read_text()
    assert "adapters' host copies stay in pageable memory in this process" in log
    assert "requests may move between adapter versions in this process" in log
