"""How much nicer vLLM's engine core makes itself (``engine/core_priority.py``)."""

from __future__ import annotations

from streamrl.engine.core_priority import DEFAULT_NICE, wanted_nice
from streamrl.engine.server import Engine, EngineConfig
from streamrl.engine.worker_env import CORE_NICE_ENV


def test_nicer_on_a_cpu_machine_only_unless_told() -> None:
    assert wanted_nice({}, on_cpu=True) == DEFAULT_NICE > 0
    assert wanted_nice({}, on_cpu=False) == 0
    assert wanted_nice({CORE_NICE_ENV: "3"}, on_cpu=False) == 3
    assert wanted_nice({CORE_NICE_ENV: "0"}, on_cpu=True) == 0
    assert wanted_nice({CORE_NICE_ENV: "-5"}, on_cpu=True) == 0  # never a higher priority than it was given
    assert wanted_nice({CORE_NICE_ENV: "high"}, on_cpu=True) == 0  # not a number: left alone, with a warning


def test_engine_config_reaches_the_engine_core_through_its_environment(monkeypatch) -> None:
    monkeypatch.delenv(CORE_NICE_ENV, raising=False)
    assert CORE_NICE_ENV not in Engine(EngineConfig(model="m")).environment()  # the engine core decides
    assert Engine(EngineConfig(model="m", core_nice=4)).environment()[CORE_NICE_ENV] == "4"
