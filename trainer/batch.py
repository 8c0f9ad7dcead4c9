"""The trainer's unit of work: one reward-tagged group (``GroupBatch``), one ``TrainSequence`` per merged
sequence. In the process it stays Python objects holding numpy arrays (what packing and the loss read);
it becomes Arrow only where it leaves or enters the process: ``--save-batches`` writes Parquet files,
``--replay`` trains from them.

Their schema (``BATCH_SCHEMA``; metadata ``streamrl.batch_version = 2``), one row per sequence:

=====================  ==================  =====================================================
column                 type                meaning
=====================  ==================  =====================================================
group_id               string              the group (all rows of a batch share it)
trajectory_id          string              the trajectory the sequence came from
request_ids            list<string>        the calls merged into this sequence, in order
token_ids              list<int32>         prompt and sampled tokens, merged across turns
loss_mask              list<int8>          1 where the token was sampled (trained), 0 elsewhere
behaviour_logprobs     list<float32>       logprob of each sampled token under the sampler; 0 elsewhere
advantage              float32             the trajectory's GRPO advantage
reward                 float32             the trajectory's reward
policy_version         int32               the oldest policy version among the merged calls
temperature            float32             the sampling temperature of the sequence's calls (the
                                           request's ``temperature``, 1.0 when absent); the trainer
                                           divides its logits by it, as vLLM did before sampling
=====================  ==================  =====================================================

Version 1 files (no ``temperature``) load with temperature 1.0.

Parquet files of these batches (``--save-batches``) are what ``--replay`` trains from.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .assembler import GREEDY_BELOW, ReadyGroup, Trajectory, filtered_sampling
from .loss import group_advantages

BATCH_SCHEMA = pa.schema(
    [
        ("group_id", pa.string()),
        ("trajectory_id", pa.string()),
        ("request_ids", pa.list_(pa.string())),
        ("token_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("behaviour_logprobs", pa.list_(pa.float32())),
        ("advantage", pa.float32()),
        ("reward", pa.float32()),
        ("policy_version", pa.int32()),
        ("temperature", pa.float32()),
    ],
    metadata={"streamrl.batch_version": "2"},
)


@dataclass(slots=True)
class TrainSequence:
    """One sequence of a step (a row of ``BATCH_SCHEMA``): what packing and the loss read first, then
    where it came from."""

    token_ids: np.ndarray
    """Prompt and sampled tokens (int32)."""
    loss_mask: np.ndarray
    """1 where the token was sampled (int8)."""
    behaviour_logprobs: np.ndarray
    """The sampler's logprob of each sampled token, 0 elsewhere (float32)."""
    advantage: float
    temperature: float = 1.0
    policy_version: int = 0
    reward: float = 0.0
    group_id: str = ""
    trajectory_id: str = ""
    request_ids: list[str] = field(default_factory=list)


_ARRAY_TYPES = {"token_ids": np.int32, "loss_mask": np.int8, "behaviour_logprobs": np.float32}


@dataclass(slots=True)
class GroupBatch:
    """A group ready to train: its sequences, all trajectories' rewards and advantages set."""

    group_id: str
    sequences: list[TrainSequence]

    def to_arrow(self) -> pa.RecordBatch:
        columns = {f.name: [getattr(s, f.name) for s in self.sequences] for f in fields(TrainSequence)}
        return pa.RecordBatch.from_pydict(columns, schema=BATCH_SCHEMA)

    @classmethod
    def from_arrow(cls, batch: pa.RecordBatch) -> GroupBatch:
        columns = {name: batch.column(name) for name in BATCH_SCHEMA.names}
        seqs = []
        for i in range(batch.num_rows):
            values = {name: (col[i].values.to_numpy(zero_copy_only=False).astype(_ARRAY_TYPES[name])
                             if name in _ARRAY_TYPES else col[i].as_py()) for name, col in columns.items()}
            seqs.append(TrainSequence(**values))
        return cls(seqs[0].group_id if seqs else "", seqs)


def group_tokens(group: ReadyGroup) -> tuple[int, int]:
    """(prompt + completion tokens, completion tokens) of a group's calls: what a step's token budget
    counts, and what the share of generated tokens trained on counts."""
    total = sampled = 0
    for t in group.trajectories:
        for c in t.completions:
            sampled += len(c.completion_token_ids)
            total += len(c.prompt_token_ids) + len(c.completion_token_ids)
    return total, sampled


def usable_group(group: ReadyGroup, *, current_version: int, max_lag: int,
                 counts: Counter[str]) -> ReadyGroup | None:
    """The group with only its trainable trajectories, judged against ``current_version``.

    Dropped and counted: trajectories more than ``max_lag`` versions behind (``stale_trajectories``),
    sampled greedily (temperature below ``GREEDY_BELOW``: no sampling distribution to correct against;
    ``greedy_trajectories``) or at an unusable temperature (``bad_temperature_trajectories``). None
    (counted) when fewer than two remain or their rewards are all equal (no learning signal).
    Trajectories sampled with top_p/top_k/min_p filtering are kept (see ``group_batch``).
    """
    kept: list[Trajectory] = []
    stale = 0
    for t in group.trajectories:
        seqs = t.sequences()
        temps = [s.temperature for s in seqs]
        if any(math.isnan(x) for x in temps):
            counts["bad_temperature_trajectories"] += 1
            continue
        if min(temps) < GREEDY_BELOW:
            counts["greedy_trajectories"] += 1
            continue
        if current_version - min(s.policy_version for s in seqs) > max_lag:
            counts["stale_trajectories"] += 1
            stale += 1
            continue
        kept.append(t)
    if len(kept) < 2:
        counts["groups_dropped_stale" if stale else "groups_dropped_unusable"] += 1
        return None
    rewards = [t.reward.reward for t in kept if t.reward is not None]
    if max(rewards) == min(rewards):
        counts["groups_no_signal"] += 1
        return None
    return ReadyGroup(group.group_id, kept, group.complete)


def group_batch(group: ReadyGroup, *, std_norm: bool, counts: Counter[str] | None = None) -> GroupBatch:
    """The batch of a group ``usable_group`` returned: merged sequences, GRPO advantages.

    Trajectories sampled with top_p/top_k/min_p filtering are counted ``filtered_sampling``: their
    importance ratios are approximate (the trainer does not re-apply the filter; see docs/trainer.md).
    """
    rewards = []
    for t in group.trajectories:
        assert t.reward is not None
        rewards.append(t.reward.reward)
        if counts is not None and any(filtered_sampling(c) for c in t.completions):
            counts["filtered_sampling"] += 1
    adv = group_advantages(rewards, std_norm=std_norm)
    seqs = [TrainSequence(s.token_ids, s.loss_mask, s.behaviour_logprobs, float(a), s.temperature, s.policy_version,
                          float(reward), group.group_id, t.trajectory_id, s.request_ids)
            for t, reward, a in zip(group.trajectories, rewards, adv, strict=True) for s in t.sequences()]
    return GroupBatch(group.group_id, seqs)


def build_batch(group: ReadyGroup, *, current_version: int, max_lag: int, std_norm: bool,
                counts: Counter[str]) -> GroupBatch | None:
    """``usable_group`` then ``group_batch``: the group's batch, or None (counted) when unusable."""
    g = usable_group(group, current_version=current_version, max_lag=max_lag, counts=counts)
    return None if g is None else group_batch(g, std_norm=std_norm, counts=counts)


def save_batch(batch: GroupBatch, directory: str | Path, name: str) -> Path:
    """Write one batch as ``<directory>/<name>.parquet`` (written to a temp name, then renamed)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    path, tmp = d / f"{name}.parquet", d / f".{name}.parquet.tmp"
    pq.write_table(pa.Table.from_batches([batch.to_arrow()], schema=BATCH_SCHEMA), tmp)
    tmp.replace(path)
    return path


def load_batches(directory: str | Path) -> list[GroupBatch]:
    """Every saved batch under ``directory``, in file-name order (one batch per group)."""
    out = []
    for path in sorted(Path(directory).glob("*.parquet")):
        table = pq.read_table(path)
        if "temperature" not in table.column_names:  # batch_version 1: sampled at temperature 1
            table = table.append_column("temperature", pa.array(np.ones(table.num_rows, np.float32)))
        table = table.select(BATCH_SCHEMA.names).cast(BATCH_SCHEMA)
        out.append(GroupBatch.from_arrow(table.combine_chunks().to_batches()[0]))
    return out
