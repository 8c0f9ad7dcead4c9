"""streamrl: agents that learn from their own use. The package's Python API for learners of your own is
``streamrl.batches`` (``streamrl/consumer.py``); everything else is reached through the ``streamrl`` command."""

from __future__ import annotations

from typing import Any

_CONSUMER = ("BATCH_SCHEMA", "BATCH_VERSION", "Batch", "BatchError", "BatchStream", "Ragged", "batches", "read_batch")


def __getattr__(name: str) -> Any:
    """The consumer API, imported on first use: ``streamrl``'s commands start without pyarrow or Kafka."""
    if name in _CONSUMER:
        from streamrl import consumer

        return getattr(consumer, name)
    raise AttributeError(f"module 'streamrl' has no attribute {name!r}")
