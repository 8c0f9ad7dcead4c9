"""The contract between the stream and any learner: a step's trainable sequences as one Arrow
``RecordBatch`` of ``BATCH_SCHEMA``, built once per step from the step's groups (``step_batch``).

Packing, the loss and the metrics read its buffers through ``Batch``, a typed view: list columns as
``Ragged`` (numpy views of the values and the offsets, no copy), scalar columns as numpy views. The same
record batch is what ``--save-batches`` writes (Parquet), what ``--replay`` reads, what
``streamrl.batches`` yields and what ``streamrl batches`` streams as Arrow IPC (``batch_io.py``).

Schema (metadata ``streamrl.batch_version = 3``), one row per sequence, rows of one group together:

=====================  ==================  =====================================================
column                 type                meaning
=====================  ==================  =====================================================
group_id               string              the group the sequence belongs to
trajectory_id          string              the trajectory the sequence came from
request_ids            list<string>        the calls merged into this sequence, in order
token_ids              list<int32>         prompt and sampled tokens, merged across turns
loss_mask              list<int8>          1 where the token was sampled (trained), 0 elsewhere
behaviour_logprobs     list<float32>       logprob of each sampled token under the sampler; 0 elsewhere
token_versions         list<int32>         the policy version that sampled each sampled token (a request
                                           the engine moved to a newer version mid-way has several);
                                           ``policy_version`` elsewhere
advantage              float32             the trajectory's GRPO advantage
reward                 float32             the trajectory's reward
policy_version         int32               the oldest version among the sequence's sampled tokens
temperature            float32             the sampling temperature of the sequence's calls (the
                                           request's ``temperature``, 1.0 when absent); the trainer
                                           divides its logits by it, as vLLM did before sampling
=====================  ==================  =====================================================

``read_batch`` admits a record batch into the process: version 1 (no ``temperature``) is read at
temperature 1.0, versions 1 and 2 (no ``token_versions``) with every token at ``policy_version``; a newer
version or a malformed batch is refused with a ``BatchError`` saying why.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from .assembler import GREEDY_BELOW, ReadyGroup, Trajectory, filtered_sampling, span_mask
from .assembler import Sequence as TrainSequence
from .loss import group_advantages

BATCH_VERSION = 3
VERSION_KEY = b"streamrl.batch_version"
SEQ_KEY = b"streamrl.seq"
"""Schema metadata of a batch handed out by a stream: its sequence number, what ``ack`` acknowledges."""

BATCH_SCHEMA = pa.schema(
    [
        ("group_id", pa.string()),
        ("trajectory_id", pa.string()),
        ("request_ids", pa.list_(pa.string())),
        ("token_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("behaviour_logprobs", pa.list_(pa.float32())),
        ("token_versions", pa.list_(pa.int32())),
        ("advantage", pa.float32()),
        ("reward", pa.float32()),
        ("policy_version", pa.int32()),
        ("temperature", pa.float32()),
    ],
    metadata={VERSION_KEY: str(BATCH_VERSION).encode()},
)
TOKEN_COLUMNS = ("token_ids", "loss_mask", "behaviour_logprobs", "token_versions")
"""List columns with one value per token: their lengths agree row by row."""


class BatchError(ValueError):
    """A record batch that is not a readable streamrl batch; ``reason`` is what it is counted under."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Ragged:
    """A list column as numpy views of its Arrow buffers: row ``i`` is ``values[offsets[i]:offsets[i + 1]]``
    (the offsets index ``values`` directly, also for a sliced column)."""

    values: np.ndarray
    offsets: np.ndarray

    @classmethod
    def of(cls, column: pa.ListArray) -> Ragged:
        return cls(column.values.to_numpy(zero_copy_only=True), column.offsets.to_numpy(zero_copy_only=True))

    def __getitem__(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i]:self.offsets[i + 1]]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def row_sums(self) -> np.ndarray:
        """Sum of each row's values (e.g. sampled tokens per sequence from ``loss_mask``)."""
        cs = np.concatenate([[0], np.cumsum(self.values, dtype=np.int64)])
        return cs[self.offsets[1:]] - cs[self.offsets[:-1]]


@dataclass(frozen=True, slots=True)
class Batch:
    """A typed, zero-copy view of a ``BATCH_SCHEMA`` record batch (``record``): what packing, the loss
    and the metrics read."""

    record: pa.RecordBatch
    token_ids: Ragged
    loss_mask: Ragged
    behaviour_logprobs: Ragged
    token_versions: Ragged
    advantage: np.ndarray
    reward: np.ndarray
    policy_version: np.ndarray
    temperature: np.ndarray

    @classmethod
    def of(cls, record: pa.RecordBatch) -> Batch:
        """The view of ``record``, which ``read_batch`` admitted or ``step_batch`` built."""
        col = record.column
        return cls(record, *(Ragged.of(col(n)) for n in TOKEN_COLUMNS),
                   *(col(n).to_numpy(zero_copy_only=True) for n in ("advantage", "reward", "policy_version",
                                                                    "temperature")))

    @property
    def rows(self) -> int:
        return self.record.num_rows

    @property
    def group_ids(self) -> list[str]:
        """Ids of the batch's groups, each once, in row order."""
        return list(dict.fromkeys(self.record.column("group_id").to_pylist()))

    @property
    def trajectory_ids(self) -> list[str]:
        """Each row's trajectory id."""
        return self.record.column("trajectory_id").to_pylist()

    def sampled_tokens(self) -> int:
        """Sampled tokens that are trained: position 0 of a sequence has no context, never a target."""
        mask = self.loss_mask
        firsts = mask.values[mask.offsets[:-1][mask.lengths > 0]]
        return int(mask.row_sums().sum() - np.count_nonzero(firsts))


def batch_seq(record: pa.RecordBatch) -> int | None:
    """The sequence number a stream stamped on ``record`` (None for one it did not hand out)."""
    meta = record.schema.metadata or {}
    return int(meta[SEQ_KEY]) if SEQ_KEY in meta else None


def with_seq(record: pa.RecordBatch, seq: int) -> pa.RecordBatch:
    """``record`` stamped with sequence number ``seq`` (schema metadata only: the buffers are shared)."""
    return record.replace_schema_metadata({**(record.schema.metadata or {}), SEQ_KEY: str(seq).encode()})


def read_batch(data: pa.RecordBatch | pa.Table) -> pa.RecordBatch:
    """``data`` as a batch of this version's schema, or a ``BatchError``.

    Version 1 (no ``temperature`` column) is read with temperature 1.0; a version newer than this
    streamrl's, a batch without the version, missing or mistyped columns, nulls and rows whose token
    columns disagree in length are refused. Columns of the right types are kept as they are (no copy).
    """
    meta = data.schema.metadata or {}
    if VERSION_KEY not in meta:
        raise BatchError("batch_no_version", "no streamrl.batch_version in the schema metadata: not a streamrl batch")
    try:
        version = int(meta[VERSION_KEY])
    except ValueError:
        raise BatchError("batch_bad_version", f"streamrl.batch_version {meta[VERSION_KEY]!r} is not a number") from None
    if version > BATCH_VERSION or version < 1:
        raise BatchError("batch_unknown_version", f"batch version {version}: this streamrl reads versions 1 to "
                         f"{BATCH_VERSION}" + (" (upgrade streamrl to read it)" if version > BATCH_VERSION else ""))
    if isinstance(data, pa.Table):
        data = data.combine_chunks()
        data = data.to_batches()[0] if data.num_rows else pa.RecordBatch.from_pylist([], schema=data.schema)
    if version == 1 and "temperature" not in data.schema.names:  # sampled at temperature 1
        data = data.append_column("temperature", pa.array(np.ones(data.num_rows, np.float32)))
    if version <= 2 and "token_versions" not in data.schema.names and "token_ids" in data.schema.names \
            and "policy_version" in data.schema.names:  # every token from the sequence's one version
        ids, versions = data.column("token_ids"), data.column("policy_version").to_numpy(zero_copy_only=False)
        lengths = np.diff(ids.offsets.to_numpy())
        data = data.append_column("token_versions", pa.ListArray.from_arrays(
            pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)),
            pa.array(np.repeat(versions.astype(np.int32), lengths))))
    missing = [n for n in BATCH_SCHEMA.names if n not in data.schema.names]
    if missing:
        raise BatchError("batch_malformed", f"version {version} batch without column(s) {', '.join(missing)}")
    columns = []
    for f in BATCH_SCHEMA:
        c = data.column(f.name)
        if not c.type.equals(f.type):
            try:
                c = c.cast(f.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise BatchError("batch_malformed", f"column {f.name} is {c.type}, not {f.type}: {exc}") from None
        nulls = c.null_count + (c.values.null_count if isinstance(c, pa.ListArray) else 0)
        if nulls:
            raise BatchError("batch_malformed", f"column {f.name} holds {nulls} null(s)")
        columns.append(c)
    out = pa.RecordBatch.from_arrays(columns, schema=BATCH_SCHEMA.with_metadata(
        {**meta, VERSION_KEY: str(BATCH_VERSION).encode()}))
    lengths = [np.diff(out.column(n).offsets.to_numpy()) for n in TOKEN_COLUMNS]
    if not all(np.array_equal(lengths[0], x) for x in lengths[1:]):
        raise BatchError("batch_malformed", "token_ids, loss_mask, behaviour_logprobs and token_versions differ in "
                         "length in a row")
    return out


def _list_column(parts: Sequence[np.ndarray], dtype: type, lengths: Sequence[int] | None = None) -> pa.ListArray:
    """One list column from its values in order (one array per row, or ``lengths`` giving how many of the
    concatenated values each row has): concatenated once into the column's buffer."""
    offsets = np.zeros((len(lengths) if lengths is not None else len(parts)) + 1, np.int32)
    np.cumsum(lengths if lengths is not None else [len(p) for p in parts], out=offsets[1:])
    values = np.concatenate(parts).astype(dtype, copy=False) if len(parts) else np.empty(0, dtype)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


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

    Dropped and counted: trajectories whose every sampled token is more than ``max_lag`` versions behind
    (``stale_trajectories``: staleness is judged per token; ``step_batch`` leaves the stale tokens of the
    trajectories kept out of the loss),
    sampled greedily (temperature below ``GREEDY_BELOW``: no sampling distribution to correct against;
    ``greedy_trajectories``) or at an unusable temperature (``bad_temperature_trajectories``). None
    (counted) when fewer than two remain or their rewards are all equal (no learning signal).
    Trajectories sampled with top_p/top_k/min_p filtering are kept (see ``step_batch``).
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
        if current_version - max(s.newest_version for s in seqs) > max_lag:
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


def step_batch(groups: Sequence[ReadyGroup], *, std_norm: bool, counts: Counter[str] | None = None,
               oldest_version: int | None = None) -> pa.RecordBatch:
    """The record batch of a step's groups (each as ``usable_group`` returned it): merged sequences, GRPO
    advantages per group, rows in group order. Built once; every column a single Arrow array.

    Sampled tokens of a version below ``oldest_version`` (the version trained minus ``max_lag``) stay in
    their sequence as context but leave the loss (``loss_mask`` 0; counted ``stale_tokens``): a request the
    engine moved to newer versions mid-way is trained on its fresh part.

    Trajectories sampled with top_p/top_k/min_p filtering are counted ``filtered_sampling``: their
    importance ratios are approximate (the trainer does not re-apply the filter; see docs/trainer.md).
    """
    trajectories, per_row = [], []
    for group in groups:
        rewards = []
        for t in group.trajectories:
            assert t.reward is not None
            rewards.append(t.reward.reward)
            if counts is not None and any(filtered_sampling(c) for c in t.completions):
                counts["filtered_sampling"] += 1
        advantages = group_advantages(rewards, std_norm=std_norm)
        for t, reward, adv in zip(group.trajectories, rewards, advantages, strict=True):
            trajectories.append((group.group_id, t.trajectory_id, reward, adv))
            per_row.append(t.sequences())
    rows = [(meta, s) for meta, seqs in zip(trajectories, per_row, strict=True) for s in seqs]
    lengths = [len(s.token_ids) for _, s in rows]
    # the mask from every sequence's span lengths, the sampled logprobs written where it is 1: one pass each
    mask = span_mask([n for _, s in rows for n in s.spans])
    logprobs = np.zeros(len(mask), np.float32)
    versions = np.repeat(np.asarray([s.policy_version for _, s in rows], np.int32), lengths)
    if rows:
        sampled = mask == 1
        logprobs[sampled] = np.concatenate([p for _, s in rows for p in s.sampled_logprobs])
        versions[sampled] = np.concatenate([v for _, s in rows for v in _sampled_versions(s)])
        if oldest_version is not None:
            stale = sampled & (versions < oldest_version)
            if stale.any():
                mask[stale] = 0
                if counts is not None:
                    counts["stale_tokens"] += int(stale.sum())
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    return _record({"group_id": [m[0] for m, _ in rows], "trajectory_id": [m[1] for m, _ in rows],
                    "request_ids": [s.request_ids for _, s in rows],
                    "token_ids": _list_column([s.token_ids for _, s in rows], np.int32, lengths),
                    "loss_mask": pa.ListArray.from_arrays(offsets, pa.array(mask)),
                    "behaviour_logprobs": pa.ListArray.from_arrays(offsets, pa.array(logprobs)),
                    "token_versions": pa.ListArray.from_arrays(offsets, pa.array(versions)),
                    "advantage": [m[3] for m, _ in rows], "reward": [m[2] for m, _ in rows],
                    "policy_version": [s.policy_version for _, s in rows], "temperature": [s.temperature for _, s in rows]})


def _sampled_versions(s: TrainSequence) -> list[np.ndarray]:
    """The versions of a sequence's sampled tokens, span by span."""
    if s.sampled_versions:
        return s.sampled_versions
    return [np.full(len(p), s.policy_version, np.int32) for p in s.sampled_logprobs]


def sequences_batch(token_ids: Sequence[np.ndarray], loss_mask: Sequence[np.ndarray], *,
                    behaviour_logprobs: Sequence[np.ndarray] | None = None, advantage: Sequence[float] | None = None,
                    temperature: Sequence[float] | None = None) -> pa.RecordBatch:
    """A batch of bare sequences (``streamrl sft``'s demonstrations, tests, benchmarks): behaviour logprobs
    0, advantage 0 and temperature 1 unless given."""
    n = len(token_ids)
    rows = {"group_id": [""] * n, "trajectory_id": [""] * n, "request_ids": [[] for _ in range(n)],
            "token_ids": list(token_ids), "loss_mask": list(loss_mask),
            "behaviour_logprobs": list(behaviour_logprobs) if behaviour_logprobs is not None
            else [np.zeros(len(t), np.float32) for t in token_ids],
            "token_versions": [np.zeros(len(t), np.int32) for t in token_ids],
            "advantage": list(advantage) if advantage is not None else [0.0] * n, "reward": [0.0] * n,
            "policy_version": [0] * n, "temperature": list(temperature) if temperature is not None else [1.0] * n}
    return _record(rows)


_NUMPY = {"token_ids": np.int32, "loss_mask": np.int8, "behaviour_logprobs": np.float32,
          "token_versions": np.int32, "advantage": np.float32,
          "reward": np.float32, "policy_version": np.int32, "temperature": np.float32}
"""The numpy type of each numeric column (of its values, for a list column)."""


def _record(rows: dict[str, list | pa.Array]) -> pa.RecordBatch:
    arrays = []
    for f in BATCH_SCHEMA:
        values = rows[f.name]
        if isinstance(values, pa.Array):
            arrays.append(values)
        elif f.name in TOKEN_COLUMNS:
            arrays.append(_list_column(values, _NUMPY[f.name]))
        elif f.name in _NUMPY:
            arrays.append(pa.array(np.asarray(values, _NUMPY[f.name])))
        else:
            arrays.append(pa.array(values, f.type))
    return pa.RecordBatch.from_arrays(arrays, schema=BATCH_SCHEMA)


def build_batch(group: ReadyGroup, *, current_version: int, max_lag: int, std_norm: bool,
                counts: Counter[str]) -> pa.RecordBatch | None:
    """One group's batch (``usable_group`` then ``step_batch``), or None (counted) when unusable."""
    g = usable_group(group, current_version=current_version, max_lag=max_lag, counts=counts)
    return None if g is None else step_batch([g], std_norm=std_norm, counts=counts,
                                             oldest_version=current_version - max_lag)


def group_slices(record: pa.RecordBatch) -> list[pa.RecordBatch]:
    """Each group's rows of ``record`` (zero-copy slices), in row order: ``--save-batches`` writes one per file."""
    ids = record.column("group_id").to_pylist()
    out, start = [], 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or ids[i] != ids[start]:
            out.append(record.slice(start, i - start))
            start = i
    return out
