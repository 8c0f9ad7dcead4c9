"""The LoRA slots an engine needs for the policies a gateway serves: one rule, for ``streamrl up`` (which sizes
and checks those of the engines it starts) and for the gateway (which checks those of engines started elsewhere,
from their capture probe's ``lora``: ``gateway/upstreams.py``). It imports nothing, so the gateway reads it
without the engine's process machinery (``server.py``)."""

from __future__ import annotations

FLAGS = {"max_loras": "--max-loras", "max_cpu_loras": "--max-cpu-loras"}
"""vLLM's flag for each slot count."""


def lora_slots(policies: int, max_loaded_versions: int) -> tuple[int, int]:
    """(``max_loras``, ``max_cpu_loras``) an engine needs for ``policies`` policies that each keep up to
    ``max_loaded_versions`` adapter versions loaded. The CPU cache holds every loaded version (beyond it vLLM
    reads an evicted adapter from disk again at its next request); the GPU slots, which bound the adapters of
    one batch and are preallocated at the largest rank, hold two per policy: the routed version and the one a
    swap is moving to (or from) run side by side without a request waiting for a slot."""
    return 2 * policies, policies * max_loaded_versions
