"""The LoRA slots an engine needs for the policies a gateway serves: one rule, for ``streamrl up`` (which sizes
and checks those of the engines it starts) and for the gateway (which checks those of engines started elsewhere,
from their capture probe's ``lora``: ``gateway/upstreams.py``). It imports nothing, so the gateway reads it
without the engine's process machinery (``server.py``)."""

from __future__ import annotations

FLAGS = {"max_loras": "--max-loras", "max_cpu_loras": "--max-cpu-loras"}
"""vLLM's flag for each slot count."""


def lora_slots(policies: int, max_loaded_versions: int) -> tuple[int, int]:
    """(``max_loras``, ``max_cpu_loras``) an engine needs for ``policies`` policies that each keep up to
    ``max_loaded_versions`` adapter versions loaded: one of each per loaded version. The CPU cache holds every loaded
    version (beyond it vLLM reads an evicted adapter from disk again at its next request). The GPU slots bound the
    adapters of one batch: vLLM's scheduler admits a waiting request whose adapter no running request uses only
    while the running ones use fewer than ``max_loras``, and pinned requests (long replies, episodes pinned to
    ``<name>@v<N>``) keep every loaded version of a policy running at once, so with fewer slots the first requests
    of a newly routed version would wait in the engine until an older version's last reply ends. Each slot is
    preallocated at the largest rank (docs/gateway.md, "LoRA slots", says what one costs)."""
    slots = policies * max_loaded_versions
    return slots, slots
