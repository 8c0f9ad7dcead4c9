"""The trainer's checkpoint, written atomically with each published version.

Exactly-once across crashes: the checkpoint holds, together, the LoRA weights, the optimizer state, the
version counter, the next offset per partition consumed so far, and the raw bytes of every record
consumed but not yet trained (the assembler's pending trajectories and ready-but-untrained groups),
plus the ids of recently trained groups. A restart loads it, re-feeds the pending records and seeks
to the stored offsets, so every record is trained at most and at least once. Kafka group offsets are
committed only after this file is on disk, for monitoring.

The file is our own (written by this module), read with ``torch.load(weights_only=False)``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

STATE_FILE = "trainer_state.pt"


@dataclass
class TrainerState:
    version: int = 0
    step: int = 0
    offsets: dict[str, int] = field(default_factory=dict)
    """Next offset per partition; for ``streamrl sft`` its position in the data: ``epoch`` and ``batch``."""
    pending: list[tuple[str, bytes]] = field(default_factory=list)
    done: list[str] = field(default_factory=list)
    policy: dict[str, Any] | None = None
    """The PolicyRecord of ``version`` (re-announced after a restart if it never reached the topic)."""
    lora: dict[str, torch.Tensor] = field(default_factory=dict)
    optimizer: dict[str, Any] = field(default_factory=dict)
    published: dict[int, float] = field(default_factory=dict)
    """When the last versions were published (epoch seconds): after a restart the feed can still skip
    what was written before version ``V - max_lag`` without reading it (``trainer/feed.py``)."""


def save_state(directory: Path, state: TrainerState) -> Path:
    """Write the checkpoint: temp file, fsync, rename over the old one, fsync the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    path, tmp = directory / STATE_FILE, directory / f".{STATE_FILE}.tmp"
    with open(tmp, "wb") as f:
        torch.save(state.__dict__, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def load_state(directory: Path) -> TrainerState | None:
    path = directory / STATE_FILE
    if not path.exists():
        return None
    data = torch.load(path, map_location="cpu", weights_only=False)
    return TrainerState(**data)
