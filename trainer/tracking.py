"""Experiment tracking: each step's metrics to Weights & Biases and/or TensorBoard (``report_to``).

Off by default. Each tracker's package (the ``tracking`` extra: ``wandb``, ``tensorboard``) is imported only
when that tracker is asked for, so a trainer without them runs as before; asking for one that is not
installed fails at start with the package to install, not at the first step. Only numbers are logged (a
step's group ids and adapter path stay in the JSONL history), under the step number.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Protocol

TRACKERS = {"wandb": "wandb", "tensorboard": "tensorboard"}
"""Tracker name -> the package it needs."""


class Tracker(Protocol):
    def log(self, values: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def check_trackers(names: tuple[str, ...]) -> None:
    """Unknown names and missing packages are errors (raised at config time, before anything starts)."""
    for name in names:
        if name not in TRACKERS:
            raise ValueError(f"report_to: unknown tracker {name!r} (known: {', '.join(TRACKERS)})")
        if importlib.util.find_spec(TRACKERS[name]) is None:
            raise ValueError(f"report_to {name!r} needs the {TRACKERS[name]!r} package: "
                             "pip install 'streamrl[tracking]'")


class WandbTracker:
    """One wandb run per trainer process; ``WANDB_MODE=offline`` writes it locally (``wandb sync`` later)."""

    def __init__(self, project: str, name: str, directory: Path, config: dict[str, Any]) -> None:
        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=project, name=name, dir=str(directory), config=config, reinit="create_new")

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class TensorBoardTracker:
    """Scalars in TensorBoard event files under ``directory`` (``tensorboard --logdir directory``)."""

    def __init__(self, directory: Path) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        directory.mkdir(parents=True, exist_ok=True)
        self.writer = EventFileWriter(str(directory))
        self.directory = directory

    def log(self, values: dict[str, float], step: int) -> None:
        import time

        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()])
        self.writer.add_event(Event(wall_time=time.time(), step=step, summary=summary))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def open_trackers(names: tuple[str, ...], directory: Path, run_name: str, config: dict[str, Any]) -> list[Tracker]:
    """``config``: the run's settings as wandb records them (secrets already masked)."""
    check_trackers(names)
    out: list[Tracker] = []
    for name in names:
        if name == "wandb":
            out.append(WandbTracker("streamrl", run_name, directory / "wandb", config))
        else:
            out.append(TensorBoardTracker(directory / "tensorboard"))
    return out


def numbers(step: dict[str, Any]) -> dict[str, float]:
    """The step's numeric metrics (not bools, ids or paths)."""
    return {k: float(v) for k, v in step.items() if isinstance(v, int | float) and not isinstance(v, bool)}
