"""``streamrl.batches``: the trainer's stream of ready, reward-tagged, staleness-checked step batches for
a learner of your own (docs/trainer.md, "Bring your own learner").

    stream = streamrl.batches(bootstrap_servers="HOST:9092", state_dir="run/stream", version=my_version)
    for batch in stream:                     # a pyarrow.RecordBatch of streamrl.BATCH_SCHEMA per step
        ...train on it, then write your checkpoint (as version v) durably...
        stream.ack(batch, v)                 # then, and only then: exactly-once across restarts

The same feed as ``streamrl trainer`` (which is a user of it): freshest groups first or backpressure
(``backlog``), the staleness cap ``max_lag`` against the version last acknowledged, ``groups_per_step`` and
``max_step_tokens``; every setting is a ``TrainerConfig`` one, given by its flat name (as its flag spells it).
"""

from __future__ import annotations

import threading
from typing import Any

from streamrl.trainer.batch import BATCH_SCHEMA, BATCH_VERSION, Batch, BatchError, Ragged, read_batch
from streamrl.trainer.config import TrainerConfig
from streamrl.trainer.stream import BatchStream

__all__ = ["BATCH_SCHEMA", "BATCH_VERSION", "Batch", "BatchError", "BatchStream", "Ragged", "batches", "read_batch"]


def batches(config: TrainerConfig | None = None, *, version: int | None = None,
            stop: threading.Event | None = None, **fields: Any) -> BatchStream:
    """A stream of step batches from the live log (or, with ``replay``, from saved Parquet batches).

    ``config`` (or ``TrainerConfig`` settings given here by their flat names, as ``TrainerConfig.load`` takes
    them: ``bootstrap_servers``, ``topic_prefix``, ``state_dir``, ``groups_per_step``, ``max_lag``, ...) says where and how; the stream keeps its position
    and acknowledgements in ``state_dir`` (default ``<adapters>/<name>/.state``). ``version``: the version
    of the learner's checkpoint when it starts (None or 0: none), so that a learner that died between its
    checkpoint and its ``ack`` resumes after the batch its checkpoint holds. ``stop`` ends the iteration.
    """
    if config is None:
        config = TrainerConfig.load(None, **fields)
    elif fields:
        raise TypeError("give a TrainerConfig or its fields, not both")
    return BatchStream(config, version=version, stop=stop)
