"""streamrl: agents that learn from their own use. The package's Python API for learners of your own is
``streamrl.batches`` (``trainer/consumer.py``); everything else is reached through the ``streamrl`` command.

The folders are layers: this one (``streamrl/``: child processes, config files and flags, usage errors, the
models streamrl can build or fetch) imports no part; the parts (``engine/``, ``gateway/``, ``broker/``,
``trainer/``, ``producers/``, ``judge/``) import it and ``broker/``; ``cli/`` (the command and ``up``) imports
them all. This module's lazy ``batches`` is the one way up, the library's front door
(tests/unit/test_layers.py holds the rule)."""

from __future__ import annotations

from typing import Any

_CONSUMER = ("BATCH_SCHEMA", "BATCH_VERSION", "Batch", "BatchError", "BatchStream", "Ragged", "batches", "read_batch")


def __getattr__(name: str) -> Any:
    """The consumer API, imported on first use: ``streamrl``'s commands start without pyarrow or Kafka."""
    if name in _CONSUMER:
        from streamrl.trainer import consumer

        return getattr(consumer, name)
    raise AttributeError(f"module 'streamrl' has no attribute {name!r}")
