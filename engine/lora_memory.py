"""Adapters' host copies in pageable memory, so that loading one does not wait behind a GPU neighbour.

vLLM 0.26 pins every tensor of an adapter it loads (``LoRAModel.from_lora_tensors``, and again after packing
in ``model_manager``), then copies the pinned tensors into the GPU slots without blocking. Beside another
process that keeps the GPU busy (a trainer sharing it), each of those operations waits for the GPU's time
slice: a rank-16 adapter of the 1.5B shape (392 tensors, 37 MB) took 705 ms to load into a generating engine
against 51 ms without the neighbour, py-spy putting 538 of 555 samples on the two ``pin_memory`` lines, and
``bench/lora_pin_bench.py`` measured the same 392 tensors into GPU slots in 671 ms pinned and 121 ms from
pageable memory beside the neighbour, 11.6 and 10.5 ms without it (docs/benchmarks.md, "Adapter loads into a
generating engine"). A load runs in the engine core's thread between two steps, so its time is a pause of
every request in flight.

``streamrl engine`` names :class:`PageableLoRAHostMemory` in vLLM's ``--worker-extension-cls``: vLLM imports
this module in each worker's process before the model (and any adapter) loads, and importing it turns the
pinning of adapters off there (:func:`pageable_lora_host_memory`). vLLM's CPU build pins nothing anyway.
Pinned to :data:`TESTED_VERSIONS`; on any other vLLM it changes nothing and says so.
"""

from __future__ import annotations

import logging

from .capture_scheduler import TESTED_VERSIONS, version_ok

log = logging.getLogger(f"vllm.{__name__}")
"""Under vLLM's logger: in the worker's process only vLLM's own logger has a handler (the engine's log)."""



def pageable_lora_host_memory() -> bool:
    """Make this process's vLLM keep adapters' host copies in pageable memory; whether it did."""
    import vllm

    if not version_ok(vllm.__version__, TESTED_VERSIONS):
        log.warning("vLLM %s is not one streamrl's adapter loading was tested with (%s): adapters stay pinned",
                    vllm.__version__, ", ".join(TESTED_VERSIONS))
        return False
    from vllm.lora import lora_model, model_manager

    lora_model.PIN_MEMORY = False
    model_manager.PIN_MEMORY = False
    log.info("adapters' host copies stay in pageable memory in this process (vLLM %s)", vllm.__version__)
    return True


class PageableLoRAHostMemory:
    """vLLM worker extension (``--worker-extension-cls``) with nothing to add to the worker: what it is for is
    the import of this module in the worker's process."""


pageable_lora_host_memory()
