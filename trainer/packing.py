"""Pack an optimizer step's sequences into micro-batches with minimal padding.

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

from .batch import TrainSequence


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


def _first_fit(items: list, size, capacity: int) -> list[list]:
    bins: list[list] = []
    room: list[int] = []
    for item in sorted(items, key=size, reverse=True):
        n = size(item)
        for i, r in enumerate(room):
            if n <= r:
                bins[i].append(item)
                room[i] -= n
                break
        else:
            bins.append([item])
            room.append(max(capacity - n, 0))
    return bins


def _row_length(row: list[TrainSequence]) -> int:
    return sum(len(s.token_ids) for s in row)


def _make(rows: list[list[TrainSequence]]) -> MicroBatch:
    width = max(_row_length(r) for r in rows)
    ids = np.zeros((len(rows), width), np.int64)
    pos = np.zeros((len(rows), width), np.int64)
    tgt, beh, adv, sidx, temp = [], [], [], [], []
    k = 0
    for r, row in enumerate(rows):
        col = 0
        for s in row:
            n = len(s.token_ids)
            ids[r, col:col + n] = s.token_ids
            pos[r, col:col + n] = np.arange(n)
            where = np.flatnonzero(s.loss_mask)
            where = where[where > 0]  # position 0 has no context; never sampled in practice
            tgt.append(r * width + col + where)
            beh.append(np.asarray(s.behaviour_logprobs, np.float32)[where])
            adv.append(np.full(len(where), s.advantage, np.float32))
            sidx.append(np.full(len(where), k))
            temp.append(np.full(len(where), s.temperature, np.float32))
            col += n
            k += 1
        pos[r, col:] = np.arange(width - col) + (pos[r, col - 1] + 1 if col else 0)  # padding continues
    return MicroBatch(torch.from_numpy(ids), torch.from_numpy(pos),
                      torch.from_numpy(np.concatenate(tgt).astype(np.int64)),
                      torch.from_numpy(np.concatenate(beh)), torch.from_numpy(np.concatenate(adv)),
                      torch.from_numpy(np.concatenate(sidx).astype(np.int64)), k,
                      sum(_row_length(r) for r in rows), torch.from_numpy(np.concatenate(temp)))


def pack(sequences: list[TrainSequence], budget: int, row_tokens: int | None = None) -> list[MicroBatch]:
    """Pack a step's sequences into micro-batches of about ``budget`` tokens."""
    rows = _first_fit(sequences, lambda s: len(s.token_ids), row_tokens or budget)
    micro: list[list[list[TrainSequence]]] = []
    for row in sorted(rows, key=_row_length, reverse=True):
        if micro and (len(micro[-1]) + 1) * _row_length(micro[-1][0]) <= budget:
            micro[-1].append(row)
        else:
            micro.append([row])
    return [_make(m) for m in micro]


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


def sampled_tokens(sequences: list[TrainSequence]) -> int:
    return int(sum(int(np.asarray(s.loss_mask)[1:].sum()) for s in sequences))
