"""The environment ``streamrl engine`` hands vLLM's processes (read by streamrl's vLLM plugin,
``engine/vllm_hooks.py``, and by ``engine/core_priority.py`` in the engine core)."""

ENGINE_ENV = "STREAMRL_ENGINE"
"""``1`` in an engine ``streamrl engine`` started: only there does streamrl's vLLM plugin install its hooks."""

PIN_ENV = "STREAMRL_PIN_LORA_MEMORY"
"""``1``: let vLLM pin adapters' host copies (``EngineConfig.pin_lora_memory``); otherwise they stay pageable."""

CORE_NICE_ENV = "STREAMRL_ENGINE_CORE_NICE"
"""How much nicer the engine core makes itself (``EngineConfig.core_nice``); unset: 10 on a CPU-only machine, 0
on a GPU one (``engine/core_priority.py``)."""
