"""Pack an optimizer step's sequences into micro-batches of at most ``budget`` tokens.

First-fit decreasing: sequences sorted longest first, each into the first micro-batch with room. A
micro-batch is one packed row (no padding at all); a sequence longer than the budget gets a micro-batch
of its own. Micro-batches are then dealt to ranks balanced by tokens for multi-GPU training.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class MicroBatch:
    input_ids: torch.Tensor        # (1, T) int64
    position_ids: torch.Tensor     # (1, T) int64, restarting at 0 per sequence
    target_positions: torch.Tensor  # (K,) positions of sampled tokens in the row
    behaviour_logprobs: torch.Tensor  # (K,)
    advantages: torch.Tensor       # (K,)
    sequence_index: torch.Tensor   # (K,) 0..n-1 within this micro-batch
    n_sequences: int

    @property
    def tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def to(self, device: torch.device) -> MicroBatch:
        return MicroBatch(self.input_ids.to(device), self.position_ids.to(device), self.target_positions.to(device),
                          self.behaviour_logprobs.to(device), self.advantages.to(device),
                          self.sequence_index.to(device), self.n_sequences)


def _make(seqs: list[dict]) -> MicroBatch:
    ids, pos, tgt, beh, adv, sidx = [], [], [], [], [], []
    offset = 0
    for i, s in enumerate(seqs):
        n = len(s["token_ids"])
        ids.append(s["token_ids"])
        pos.append(np.arange(n))
        where = np.flatnonzero(s["loss_mask"])
        where = where[where > 0]  # position 0 has no context; never sampled in practice
        tgt.append(where + offset)
        beh.append(s["behaviour_logprobs"][where])
        adv.append(np.full(len(where), s["advantage"], np.float32))
        sidx.append(np.full(len(where), i))
        offset += n
    return MicroBatch(
        torch.from_numpy(np.concatenate(ids).astype(np.int64))[None],
        torch.from_numpy(np.concatenate(pos).astype(np.int64))[None],
        torch.from_numpy(np.concatenate(tgt).astype(np.int64)),
        torch.from_numpy(np.concatenate(beh).astype(np.float32)),
        torch.from_numpy(np.concatenate(adv)),
        torch.from_numpy(np.concatenate(sidx).astype(np.int64)),
        len(seqs),
    )


def pack(sequences: list[dict], budget: int) -> list[MicroBatch]:
    """Pack sequences (dicts from ``batch.rows``) into micro-batches of at most ``budget`` tokens."""
    bins: list[list[dict]] = []
    room: list[int] = []
    for s in sorted(sequences, key=lambda s: len(s["token_ids"]), reverse=True):
        n = len(s["token_ids"])
        for i, r in enumerate(room):
            if n <= r:
                bins[i].append(s)
                room[i] -= n
                break
        else:
            bins.append([s])
            room.append(max(budget - n, 0))
    return [_make(b) for b in bins]


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


def sampled_tokens(sequences: list[dict]) -> int:
    return int(sum(int(s["loss_mask"][1:].sum()) for s in sequences))
