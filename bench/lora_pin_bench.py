"""Why an adapter load stalls beside a GPU neighbour: host memory for the adapter's tensors, four ways.

``bench/lora_load_bench.py`` found a load into a generating engine taking ~50 ms alone and ~700 ms while
another process kept the GPU busy (a trainer sharing it), and py-spy put nearly all of the difference on
two lines of vLLM 0.26's ``LoRAModel.from_lora_tensors``: ``tensor.pin_memory()``, once per tensor. This
bench takes that step out of vLLM: the tensors of one adapter of the trainer's shape (rank ``--rank`` on
all seven linear layers of every block, in bf16) go from pageable host memory into GPU slots of their
shape, as a load and its activation do, in each of these ways:

  pin        each tensor pinned on its own, then copied into its slot without blocking (vLLM 0.26)
  pageable   each tensor copied into its slot straight from pageable memory
  arena      each tensor copied into its place in one pinned buffer allocated once, then into its slot
  staged     the tensors packed into one pageable buffer, one copy of it to the GPU, then a device copy
             into each slot

each round ending when the GPU has every byte (``torch.cuda.synchronize``); rounds alternate between the
ways, first with the GPU otherwise idle, then beside a process running bf16 matmuls without pause. Reported:
per way, the median and worst round in ms, and its ratio to ``pin`` in the same phase.

    python bench/lora_pin_bench.py [--rounds 5] [--rank 16] [--json PATH]     # needs a CUDA GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

WAYS = ("pin", "pageable", "arena", "staged")

# Qwen2.5-1.5B: hidden 1536, intermediate 8960, 2 KV heads of 128, 28 blocks
SHAPE = {"hidden": 1536, "intermediate": 8960, "kv": 256, "layers": 28}


def adapter_shapes(rank: int) -> list[tuple[int, int]]:
    """(rows, cols) of every lora_A and lora_B of one adapter on all seven linear layers of every block."""
    h, i, kv = SHAPE["hidden"], SHAPE["intermediate"], SHAPE["kv"]
    per_block = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)]  # q k v o gate up down: (in, out)
    shapes = []
    for _ in range(SHAPE["layers"]):
        for fan_in, fan_out in per_block:
            shapes += [(rank, fan_in), (fan_out, rank)]
    return shapes


def neighbour() -> None:
    """The GPU's other tenant: bf16 matmuls back to back until killed (a trainer's steady state)."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    print("ready", flush=True)
    while True:
        for _ in range(20):
            a = torch.tanh(a @ a)
        torch.cuda.synchronize()


class Load:
    """One adapter's tensors in pageable memory and the GPU slots they go into."""

    def __init__(self, rank: int) -> None:
        self.shapes = adapter_shapes(rank)
        self.host = [torch.randn(s, dtype=torch.bfloat16) for s in self.shapes]
        self.slots = [torch.empty(s, dtype=torch.bfloat16, device="cuda") for s in self.shapes]
        self.bytes = sum(t.numel() * t.element_size() for t in self.host)
        self.arena = torch.empty(self.bytes // 2, dtype=torch.bfloat16, pin_memory=True)
        self.stage = torch.empty(self.bytes // 2, dtype=torch.bfloat16, device="cuda")

    def run(self, way: str) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        if way == "pin":
            pinned = [t.pin_memory() for t in self.host]
            for slot, t in zip(self.slots, pinned, strict=True):
                slot.copy_(t, non_blocking=True)
        elif way == "pageable":
            for slot, t in zip(self.slots, self.host, strict=True):
                slot.copy_(t, non_blocking=True)
        elif way == "arena":
            pos = 0
            for slot, t in zip(self.slots, self.host, strict=True):
                view = self.arena[pos:pos + t.numel()].view(t.shape)
                view.copy_(t)
                slot.copy_(view, non_blocking=True)
                pos += t.numel()
        elif way == "staged":
            flat = torch.cat([t.reshape(-1) for t in self.host])
            self.stage.copy_(flat)
            pos = 0
            for slot in self.slots:
                slot.copy_(self.stage[pos:pos + slot.numel()].view(slot.shape), non_blocking=True)
                pos += slot.numel()
        else:
            raise ValueError(way)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1000


def host_allocs() -> int | None:
    """cudaHostAlloc calls so far of torch's caching host allocator (None where torch does not say)."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    return None if stats is None else int(stats().get("num_host_alloc", 0))


def phase(load: Load, rounds: int) -> dict[str, object]:
    times: dict[str, list[float]] = {w: [] for w in WAYS}
    allocs0 = host_allocs()
    for r in range(rounds):
        for way in WAYS if r % 2 == 0 else WAYS[::-1]:
            times[way].append(load.run(way))
    pin = statistics.median(times["pin"])
    out: dict[str, object] = {w: {"median_ms": statistics.median(t), "max_ms": max(t),
                                  "vs_pin": statistics.median(t) / pin} for w, t in times.items()}
    allocs = host_allocs()
    out["host_allocs"] = None if allocs is None or allocs0 is None else allocs - allocs0
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--json", type=Path)
    p.add_argument("--neighbour", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.neighbour:
        neighbour()
        return
    load = Load(args.rank)
    load.run("pin")  # first touches: CUDA context, allocator
    results: dict[str, object] = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                                  "tensors": len(load.shapes), "bytes": load.bytes, "rank": args.rank}
    results["idle"] = phase(load, args.rounds)
    proc = subprocess.Popen([sys.executable, __file__, "--neighbour"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        time.sleep(1)
        results["neighbour"] = phase(load, args.rounds)
    finally:
        proc.kill()
        proc.wait()
    print(f"{len(load.shapes)} tensors, {load.bytes / 1e6:.1f} MB, rank {args.rank}, {results['gpu']}; "
          f"cudaHostAlloc calls idle / beside the neighbour: {results['idle']['host_allocs']} / "
          f"{results['neighbour']['host_allocs']}")
    print("| way | idle: median / max (ms) | vs pin | GPU neighbour: median / max (ms) | vs pin |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for way in WAYS:
        i, n = results["idle"][way], results["neighbour"][way]
        print(f"| {way} | {i['median_ms']:.1f} / {i['max_ms']:.1f} | {i['vs_pin']:.2f} | "
              f"{n['median_ms']:.1f} / {n['max_ms']:.1f} | {n['vs_pin']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
