"""The trainer's unit of work: one reward-tagged group as a pyarrow RecordBatch, one row per sequence.

Schema (``BATCH_SCHEMA``; metadata ``streamrl.batch_version = 1``):

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
=====================  ==================  =====================================================

Parquet files of these batches (``--save-batches``) are what ``--replay`` trains from.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .assembler import ReadyGroup, Sequence, merge_calls
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
    ],
    metadata={"streamrl.batch_version": "1"},
)


def build_batch(group: ReadyGroup, *, current_version: int, max_lag: int, std_norm: bool,
                counts: Counter[str]) -> pa.RecordBatch | None:
    """Merge each trajectory's calls, drop stale trajectories, compute advantages. None (counted) when
    the group ends up with fewer than two trajectories or all-equal rewards (no learning signal)."""
    kept: list[tuple[str, float, list[Sequence]]] = []
    for t in group.trajectories:
        seqs = merge_calls(t.completions)
        lag = current_version - min(s.policy_version for s in seqs)
        if lag > max_lag:
            counts["stale_trajectories"] += 1
            continue
        assert t.reward is not None
        kept.append((t.trajectory_id, t.reward.reward, seqs))
    if len(kept) < 2:
        counts["groups_dropped_stale"] += 1
        return None
    rewards = [r for _, r, _ in kept]
    if max(rewards) == min(rewards):
        counts["groups_no_signal"] += 1
        return None
    adv = group_advantages(rewards, std_norm=std_norm)
    rows: dict[str, list] = {name: [] for name in BATCH_SCHEMA.names}
    for (tid, reward, seqs), a in zip(kept, adv, strict=True):
        for s in seqs:
            rows["group_id"].append(group.group_id)
            rows["trajectory_id"].append(tid)
            rows["request_ids"].append(s.request_ids)
            rows["token_ids"].append(s.token_ids)
            rows["loss_mask"].append(s.loss_mask)
            rows["behaviour_logprobs"].append(s.behaviour_logprobs)
            rows["advantage"].append(a)
            rows["reward"].append(reward)
            rows["policy_version"].append(s.policy_version)
    return pa.RecordBatch.from_pydict(rows, schema=BATCH_SCHEMA)


def rows(batch: pa.RecordBatch) -> list[dict]:
    """The sequences of a batch as numpy arrays (what packing and the loss consume)."""
    cols = {name: batch.column(name) for name in BATCH_SCHEMA.names}
    out = []
    for i in range(batch.num_rows):
        out.append({
            "group_id": cols["group_id"][i].as_py(),
            "trajectory_id": cols["trajectory_id"][i].as_py(),
            "token_ids": cols["token_ids"][i].values.to_numpy(zero_copy_only=False).astype(np.int64),
            "loss_mask": cols["loss_mask"][i].values.to_numpy(zero_copy_only=False).astype(bool),
            "behaviour_logprobs": cols["behaviour_logprobs"][i].values.to_numpy(zero_copy_only=False),
            "advantage": float(cols["advantage"][i].as_py()),
            "policy_version": int(cols["policy_version"][i].as_py()),
        })
    return out


def save_batch(batch: pa.RecordBatch, directory: str | Path, name: str) -> Path:
    """Write one batch as ``<directory>/<name>.parquet`` (written to a temp name, then renamed)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    path, tmp = d / f"{name}.parquet", d / f".{name}.parquet.tmp"
    pq.write_table(pa.Table.from_batches([batch], schema=BATCH_SCHEMA), tmp)
    tmp.replace(path)
    return path


def load_batches(directory: str | Path) -> list[pa.RecordBatch]:
    """Every saved batch under ``directory``, in file-name order (one batch per group)."""
    out = []
    for path in sorted(Path(directory).glob("*.parquet")):
        table = pq.read_table(path, schema=BATCH_SCHEMA)
        out.append(table.combine_chunks().to_batches()[0])
    return out
