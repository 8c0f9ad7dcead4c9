"""The environment ``streamrl engine`` hands vLLM's processes (read by ``engine/worker.py`` in the workers and
``engine/core_priority.py`` in the engine core)."""

PIN_ENV = "STREAMRL_PIN_LORA_MEMORY"
"""``1``: let vLLM pin adapters' host copies (``EngineConfig.pin_lora_memory``); otherwise they stay pageable."""

CORE_NICE_ENV = "STREAMRL_ENGINE_CORE_NICE"
"""How much nicer the engine core makes itself (``EngineConfig.core_nice``); unset: 10 on a CPU-only machine, 0
on a GPU one (``engine/core_priority.py``)."""
