"""Pack an optimizer step's sequences (the rows of its ``Batch``, read from the Arrow buffers without a
Python object per row) into micro-batches with minimal padding.

Two levels, both first-fit decreasing:

* rows: sequences (longest first) go into the first row with room for them, up to ``row_tokens``;
  within a row ``position_ids`` restart at 0 for each sequence, so packed sequences never attend to
  each other (a row holding exactly one sequence keeps the plain causal mask, i.e. flash attention);
* micro-batches: rows (longest first) are stacked while ``rows x longest row`` fits ``budget`` tokens;
  shorter rows are padded at the end (pad positions continue the row's positions and are never
  targets, and causal attention keeps real tokens from seeing them).

A sequence longer than ``row_tokens`` gets a row of its own. Micro-batches are then dealt to ranks,
balanced by tokens, for multi-GPU training.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .batch import Batch


@dataclass
class MicroBatch:
    input_ids: torch.Tensor           # (R, T) int64
    position_ids: torch.Tensor        # (R, T) int64, restarting at 0 per sequence
    target_positions: torch.Tensor    # (K,) flat indices (row * T + column) of sampled tokens
    behaviour_logprobs: torch.Tensor  # (K,)
    advantages: torch.Tensor          # (K,)
    sequence_index: torch.Tensor      # (K,) 0..n-1 within this micro-batch
    n_sequences: int
    real_tokens: int                  # tokens excluding padding
    temperatures: torch.Tensor        # (K,) sampling temperature of each target's sequence

    @property
    def tokens(self) -> int:
        return int(self.input_ids.numel())

    def to(self, device: torch.device) -> MicroBatch:
        return MicroBatch(self.input_ids.to(device), self.position_ids.to(device), self.target_positions.to(device),
                          self.behaviour_logprobs.to(device), self.advantages.to(device),
                          self.sequence_index.to(device), self.n_sequences, self.real_tokens,
                          self.temperatures.to(device))


def _first_fit(sizes: np.ndarray, capacity: int) -> list[list[int]]:
    """Indices into ``sizes`` in bins of at most ``capacity`` (an item larger than that gets its own)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for item in np.argsort(-sizes, kind="stable").tolist():
        n = int(sizes[item])
        for i, r in enumerate(room):
            if n <= r:
                bins[i].append(item)
                room[i] -= n
                break
        else:
            bins.append([item])
            room.append(max(capacity - n, 0))
    return bins


def _make(batch: Batch, rows: list[list[int]], lengths: np.ndarray) -> MicroBatch:
    """The micro-batch of ``rows`` (each a list of the batch's row indices), read from the batch's buffers:
    token slices copied straight from the Arrow values, the sampled targets found in one vectorised pass."""
    per_row = [len(row) for row in rows]
    order = [i for row in rows for i in row]
    row_of = np.repeat(np.arange(len(rows)), per_row)
    n = lengths[order].astype(np.int64)
    ends = np.cumsum(n)
    starts = ends - n
    last = np.cumsum(per_row) - 1  # each row's last sequence, in ``order``
    row_starts = np.concatenate([[0], ends[last][:-1]])
    widths = ends[last] - row_starts
    width = int(widths.max())
    col = starts - row_starts[row_of]  # where each sequence starts in its row
    # padding (after a row's last sequence) continues that sequence's positions; real tokens overwrite the rest
    pos = np.arange(width, dtype=np.int64)[None, :] + (n[last] - widths)[:, None]
    ids = np.zeros((len(rows), width), np.int64)
    offsets, tokens = batch.token_ids.offsets, batch.token_ids.values
    mask, behaviour = batch.loss_mask.values, batch.behaviour_logprobs.values
    positions = np.arange(int(n.max()), dtype=np.int64)
    masks, behaviours = [], []
    for r, c, length, i in zip(row_of.tolist(), col.tolist(), n.tolist(), order, strict=True):
        o = int(offsets[i])
        ids[r, c:c + length] = tokens[o:o + length]
        pos[r, c:c + length] = positions[:length]
        masks.append(mask[o:o + length])
        behaviours.append(behaviour[o:o + length])
    idx = np.flatnonzero(np.concatenate(masks))  # sampled tokens, in the sequences' placement order
    idx = idx[np.isin(idx, starts, invert=True)]  # position 0 has no context; never sampled in practice
    per_seq = np.diff(np.searchsorted(idx, np.append(starts, ends[-1])))  # sampled tokens of each sequence
    chosen = np.asarray(order, np.int64)
    return MicroBatch(torch.from_numpy(ids), torch.from_numpy(pos),
                      torch.from_numpy(idx + np.repeat(row_of * width + col - starts, per_seq)),
                      torch.from_numpy(np.concatenate(behaviours)[idx].astype(np.float32, copy=False)),
                      torch.from_numpy(np.repeat(batch.advantage[chosen].astype(np.float32), per_seq)),
                      torch.from_numpy(np.repeat(np.arange(len(order), dtype=np.int64), per_seq)), len(order),
                      int(ends[-1]), torch.from_numpy(np.repeat(batch.temperature[chosen].astype(np.float32), per_seq)))


def pack(batch: Batch, budget: int, row_tokens: int | None = None) -> list[MicroBatch]:
    """Pack a step's sequences into micro-batches of about ``budget`` tokens."""
    lengths = batch.token_ids.lengths
    rows = _first_fit(lengths, row_tokens or budget)
    row_len = [int(lengths[r].sum()) for r in rows]
    micro: list[list[list[int]]] = []
    width = 0
    for j in sorted(range(len(rows)), key=lambda j: -row_len[j]):
        if micro and (len(micro[-1]) + 1) * width <= budget:
            micro[-1].append(rows[j])
        else:
            micro.append([rows[j]])
            width = row_len[j]
    return [_make(batch, m, lengths) for m in micro]


def deal(micro_batches: list[MicroBatch], world_size: int, rank: int) -> list[MicroBatch]:
    """This rank's share: micro-batches dealt greedily to the rank with the fewest tokens so far."""
    load = [0] * world_size
    mine = []
    for mb in sorted(micro_batches, key=lambda m: m.tokens, reverse=True):
        r = min(range(world_size), key=load.__getitem__)
        load[r] += mb.tokens
        if r == rank:
            mine.append(mb)
    return mine


