"""The environment ``streamrl engine`` hands vLLM's worker processes (read by ``engine/worker.py`` there)."""

PIN_ENV = "STREAMRL_PIN_LORA_MEMORY"
"""``1``: let vLLM pin adapters' host copies (``EngineConfig.pin_lora_memory``); otherwise they stay pageable."""
