"""The trainer's checkpoint, written atomically with each published version.

It holds the LoRA weights, the optimizer state and the version counter; where the batch stream stands
(offsets, records consumed but not yet trained, closed group ids) is the stream's own
(``feed_state.py``), acknowledged with this version right after this file is on disk, so a restart
that finds this checkpoint newer than the acknowledgement continues after the batch it holds
(exactly-once; docs/trainer.md).

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
    """The next offset of every partition the checkpoint's version has read through (a record: the stream
    keeps its own position); for ``streamrl sft`` its position in the data: ``epoch`` and ``batch``. A trainer
    checkpoint written before the stream kept its own position holds that position here, with ``pending``,
    ``done`` and ``published``: read once to start the stream there (``daemon.legacy_position``); they are
    written empty since."""
    pending: list[tuple[str, bytes]] = field(default_factory=list)
    done: list[str] = field(default_factory=list)
    policy: dict[str, Any] | None = None
    """The PolicyRecord of ``version`` (re-announced after a restart if it never reached the topic)."""
    lora: dict[str, torch.Tensor] = field(default_factory=dict)
    optimizer: dict[str, Any] = field(default_factory=dict)
    published: dict[int, float] = field(default_factory=dict)


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
