"""A step's batch: assembly (ready groups -> the learner's input) and packing (-> micro-batches), time per
step and peak memory, the Arrow path (one ``RecordBatch`` per step read through zero-copy views) against
the per-sequence Python objects the trainer used before (a ``TrainSequence`` dataclass per sequence, a
list per group), in the same run on the same groups.

    python3 bench/batch_bench.py --out batch_bench.json

Shapes (``--shapes``): ``agent`` (8 groups of 8 trajectories, each 3 calls merged into one sequence of
~1.9k tokens: prompt 1024, completions 256, tool results 128), ``long`` (8 groups of 8 single-call 4k-token
sequences, the trainer bench's 7B rows), ``short`` (32 groups of 8 single-call 300-token sequences).
Packing as the GPU configuration packs (``row_tokens`` 4096, ``micro_batch_tokens`` 32768). Assembly
includes the calls' merge (``merge_calls``; the objects path with the merge as it was, concatenating each
sequence's parts, the Arrow path concatenating every sequence's parts once into the batch's buffers).
Peak memory: tracemalloc's peak (numpy and Python objects) plus the bytes Arrow's pool holds at the end of
assembly, per step, the step's groups already in memory and dropped once assembled, as the feed drops
them. Reported per path: median and best seconds per step over ``--repeats``, peak bytes, and the ratios
objects/Arrow (above 1: Arrow faster or smaller). Both paths' micro-batches are checked equal first.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import tracemalloc
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
try:
    import streamrl.trainer
except ImportError:  # not installed: map the repository's folders (streamrl.trainer -> trainer/)
    sys.path.insert(0, str(ROOT))
    import streamrl

    streamrl.__path__.append(str(ROOT))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import torch  # noqa: E402

from streamrl.broker.schema import CompletionRecord, RewardRecord  # noqa: E402
from streamrl.trainer.assembler import Assembler, ReadyGroup, filtered_sampling, sampling_temperature  # noqa: E402
from streamrl.trainer.batch import Batch, step_batch  # noqa: E402
from streamrl.trainer.loss import group_advantages  # noqa: E402
from streamrl.trainer.packing import MicroBatch, pack  # noqa: E402

SHAPES = {  # groups, trajectories per group, calls per trajectory, prompt, completion, tool tokens
    "agent": (8, 8, 3, 1024, 256, 128),
    "long": (8, 8, 1, 64, 4032, 0),
    "short": (32, 8, 1, 200, 100, 0),
}
ROW_TOKENS, MICRO_BATCH_TOKENS = 4096, 32768


def make_groups(shape: str, seed: int = 0) -> list[ReadyGroup]:
    n_groups, size, calls, prompt, completion, tool = SHAPES[shape]
    rng = np.random.default_rng(seed)
    a = Assembler(group_size=size, group_timeout_s=1e9, ttl_s=1e9, max_trajectories=10**6)
    for g in range(n_groups):
        for t in range(size):
            tid = f"{shape}-{g}-{t}"
            context = rng.integers(10, 150_000, prompt).astype(np.int32)  # the types records decode to
            for c in range(calls):
                out = rng.integers(10, 150_000, completion).astype(np.int32)
                a.add(CompletionRecord(request_id=f"{tid}-{c}", trajectory_id=tid, group_id=f"g{g}",
                                       prompt_token_ids=context, completion_token_ids=out,
                                       logprobs=rng.normal(-1.0, 0.3, completion).astype(np.float32)), b"", now=0)
                context = np.concatenate([context, out, rng.integers(10, 150_000, tool).astype(np.int32)])
            a.add(RewardRecord(tid, float(rng.random()), group_id=f"g{g}"), b"", now=0)
    return a.poll(now=0)


# ---- the per-sequence objects the trainer used before the Arrow batch (the baseline) ----------------


@dataclass(slots=True)
class TrainSequence:
    token_ids: np.ndarray
    loss_mask: np.ndarray
    behaviour_logprobs: np.ndarray
    advantage: float
    temperature: float = 1.0
    policy_version: int = 0
    reward: float = 0.0
    group_id: str = ""
    trajectory_id: str = ""
    request_ids: list[str] = field(default_factory=list)


@dataclass
class _Open:
    tokens: list[np.ndarray]
    masks: list[np.ndarray]
    logprobs: list[np.ndarray]
    current: np.ndarray
    request_ids: list[str]
    version: int
    temperature: float

    def extend(self, prompt_tail: np.ndarray, completion: np.ndarray, logprobs: np.ndarray) -> None:
        self.tokens += [prompt_tail, completion]
        self.masks += [np.zeros(len(prompt_tail), np.int8), np.ones(len(completion), np.int8)]
        self.logprobs += [np.zeros(len(prompt_tail), np.float32), logprobs.astype(np.float32)]
        self.current = np.concatenate([self.current, prompt_tail, completion])

    def continued_by(self, prompt: np.ndarray, temperature: float) -> bool:
        n = len(self.current)
        return temperature == self.temperature and len(prompt) >= n and np.array_equal(prompt[:n], self.current)


def objects_merge(completions: list[CompletionRecord]) -> list[tuple]:
    """The calls' merge as it was: each sequence's tokens, mask and logprobs concatenated."""
    open_: list[_Open] = []
    for c in sorted(completions, key=lambda c: len(c.prompt_token_ids)):
        p, temp = c.prompt_token_ids, sampling_temperature(c)
        into = max((o for o in open_ if o.continued_by(p, temp)), key=lambda o: len(o.current), default=None)
        if into is None:
            into = _Open([], [], [], np.empty(0, np.int32), [c.request_id], c.policy_version, temp)
            open_.append(into)
        else:
            into.request_ids = [*into.request_ids, c.request_id]
            into.version = min(into.version, c.policy_version)
        into.extend(p[len(into.current):], c.completion_token_ids, c.logprobs)
    return [(np.concatenate(o.tokens), np.concatenate(o.masks), np.concatenate(o.logprobs), o.request_ids, o.version,
             o.temperature) for o in open_]


def objects_assemble(groups: list[ReadyGroup], counts: Counter[str]) -> list[TrainSequence]:
    out = []
    for group in groups:
        rewards = []
        for t in group.trajectories:
            rewards.append(t.reward.reward)
            if any(filtered_sampling(c) for c in t.completions):
                counts["filtered_sampling"] += 1
        adv = group_advantages(rewards, std_norm=True)
        out += [TrainSequence(tok, mask, lp, float(a), temp, version, float(r), group.group_id, t.trajectory_id, rids)
                for t, r, a in zip(group.trajectories, rewards, adv, strict=True)
                for tok, mask, lp, rids, version, temp in objects_merge(t.completions)]
    return out


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
            where = where[where > 0]
            tgt.append(r * width + col + where)
            beh.append(np.asarray(s.behaviour_logprobs, np.float32)[where])
            adv.append(np.full(len(where), s.advantage, np.float32))
            sidx.append(np.full(len(where), k))
            temp.append(np.full(len(where), s.temperature, np.float32))
            col += n
            k += 1
        pos[r, col:] = np.arange(width - col) + (pos[r, col - 1] + 1 if col else 0)
    return MicroBatch(torch.from_numpy(ids), torch.from_numpy(pos),
                      torch.from_numpy(np.concatenate(tgt).astype(np.int64)),
                      torch.from_numpy(np.concatenate(beh)), torch.from_numpy(np.concatenate(adv)),
                      torch.from_numpy(np.concatenate(sidx).astype(np.int64)), k,
                      sum(_row_length(r) for r in rows), torch.from_numpy(np.concatenate(temp)))


def objects_pack(sequences: list[TrainSequence], budget: int, row_tokens: int) -> list[MicroBatch]:
    rows = _first_fit(sequences, lambda s: len(s.token_ids), row_tokens)
    micro: list[list[list[TrainSequence]]] = []
    for row in sorted(rows, key=_row_length, reverse=True):
        if micro and (len(micro[-1]) + 1) * _row_length(micro[-1][0]) <= budget:
            micro[-1].append(row)
        else:
            micro.append([row])
    return [_make(m) for m in micro]


# ---- the measurement -------------------------------------------------------------------------------


def arrow_step(groups: list[ReadyGroup], release: bool = False) -> tuple[float, float, list[MicroBatch], int]:
    for g in groups:  # merged again, as the objects path merges
        for t in g.trajectories:
            t._merged = None
    t0 = time.perf_counter()
    batch = Batch.of(step_batch(groups, std_norm=True, counts=Counter()))
    if release:  # as in the feed: the step's groups are dropped once their batch is built
        groups.clear()
    t1 = time.perf_counter()
    arrow_bytes = pa.total_allocated_bytes()
    micro = pack(batch, MICRO_BATCH_TOKENS, ROW_TOKENS)
    return t1 - t0, time.perf_counter() - t1, micro, arrow_bytes


def objects_step(groups: list[ReadyGroup], release: bool = False) -> tuple[float, float, list[MicroBatch], int]:
    t0 = time.perf_counter()
    seqs = objects_assemble(groups, Counter())
    if release:
        groups.clear()
    t1 = time.perf_counter()
    micro = objects_pack(seqs, MICRO_BATCH_TOKENS, ROW_TOKENS)
    return t1 - t0, time.perf_counter() - t1, micro, 0


def peak_bytes(step, shape: str) -> int:
    """Peak bytes allocated by one step on fresh groups (made before tracing), dropped once assembled."""
    groups = make_groups(shape)
    gc.collect()
    tracemalloc.start()
    base = pa.total_allocated_bytes()
    _, _, micro, arrow_bytes = step(groups, release=True)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del micro
    return peak + max(arrow_bytes - base, 0)


def same_micro_batches(a: list[MicroBatch], b: list[MicroBatch]) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x.input_ids, y.input_ids) and torch.equal(x.position_ids, y.position_ids)
        and torch.equal(x.target_positions, y.target_positions) and torch.equal(x.behaviour_logprobs, y.behaviour_logprobs)
        and torch.equal(x.advantages, y.advantages) and torch.equal(x.temperatures, y.temperatures) for x, y in zip(a, b, strict=True))


def run(shape: str, repeats: int) -> dict:
    groups = make_groups(shape)
    tokens = sum(len(s.token_ids) for g in groups for t in g.trajectories for s in t.sequences())
    out: dict = {"shape": shape, "groups": len(groups), "sequences": sum(len(t.sequences()) for g in groups
                                                                          for t in g.trajectories), "tokens": tokens}
    assert same_micro_batches(arrow_step(groups)[2], objects_step(groups)[2]), "the two paths disagree"
    for name, step in (("objects", objects_step), ("arrow", arrow_step)):
        step(groups)  # warm-up
        times = [step(groups)[:2] for _ in range(repeats)]
        total = [a + p for a, p in times]
        out[name] = {"assemble_s": statistics.median(a for a, _ in times), "pack_s": statistics.median(p for _, p in times),
                     "step_s": statistics.median(total), "step_best_s": min(total), "peak_bytes": peak_bytes(step, shape)}
    o, a = out["objects"], out["arrow"]
    out["speedup"] = {k: o[k] / a[k] for k in ("assemble_s", "pack_s", "step_s", "step_best_s")}
    out["memory_ratio"] = o["peak_bytes"] / a["peak_bytes"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="agent,long,short")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    torch.set_num_threads(1)
    results = []
    for shape in args.shapes.split(","):
        results.append(run(shape, args.repeats))
        print(json.dumps(results[-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"row_tokens": ROW_TOKENS, "micro_batch_tokens": MICRO_BATCH_TOKENS,
                                        "results": results}, indent=2))


if __name__ == "__main__":
    main()
