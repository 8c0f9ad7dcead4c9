"""What ``streamrl engine`` adds in vLLM's worker processes, named in vLLM's ``--worker-extension-cls``: vLLM
imports this module in each worker's process before the model and any adapter load, and the import does it.

* adapters' host copies in pageable memory (``engine/lora_memory.py``), unless the engine was asked to let vLLM
  pin them (:data:`PIN_ENV` set to ``1`` by ``Engine.environment``);
* in-flight updates' worker half (``engine/inflight.py``): a step's moved requests run on their new adapter.
"""

from __future__ import annotations

import os

from .inflight import install_worker_hook
from .worker_env import PIN_ENV

if os.environ.get(PIN_ENV) != "1":
    from . import lora_memory  # noqa: F401  (importing it turns pinning off in this process)

install_worker_hook()


class StreamrlWorkerExtension:
    """vLLM worker extension with no method to add: what it is for is the import of this module."""
