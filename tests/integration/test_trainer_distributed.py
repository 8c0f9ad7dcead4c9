"""Two ranks (torch.distributed, gloo, CPU) train exactly what one process trains: micro-batches split
across ranks, LoRA gradients all-reduced, loss denominators those of the whole step."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from streamrl.broker.embedded import free_port
from streamrl.broker.schema import CompletionRecord, RewardRecord
from streamrl.trainer.assembler import Assembler
from streamrl.trainer.batch import build_batch
from streamrl.trainer.batch_io import save_parquet


def write_batches(directory: Path, n_groups: int = 4) -> None:
    rng = np.random.default_rng(3)
    a = Assembler(group_size=4, group_timeout_s=60, ttl_s=600, max_trajectories=1000)
    for g in range(n_groups):
        for i in range(4):
            tid = f"g{g}-t{i}"
            n = int(rng.integers(6, 40))
            a.add(CompletionRecord(request_id=tid, trajectory_id=tid, group_id=f"g{g}",
                                   prompt_token_ids=rng.integers(10, 2000, 10), completion_token_ids=rng.integers(10, 2000, n),
                                   logprobs=rng.normal(-7.6, 0.1, n)), b"", now=0)
            a.add(RewardRecord(tid, float(rng.random()), group_id=f"g{g}"), b"", now=0)
    for i, group in enumerate(a.poll(now=0)):
        save_parquet(build_batch(group, current_version=0, max_lag=4, std_norm=True, counts=Counter()), directory, f"{i:04d}")


def start_replay(tiny_model: Path, batches: Path, adapters: Path, nproc: int) -> subprocess.Popen:
    args = ["-m", "streamrl.cli", "trainer", "--model", str(tiny_model), "--replay", str(batches), "--adapters",
            str(adapters), "--groups-per-step", "2", "--device", "cpu", "--micro-batch-tokens", "128",
            "--max-step-tokens", "0"]
    cmd = [sys.executable, *args] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
        str(free_port()), *args]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)


def trained(proc: subprocess.Popen, adapters: Path) -> dict[str, torch.Tensor]:
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return load_file(adapters / "policy" / "v2" / "adapter_model.safetensors")


def test_two_ranks_match_one_process(tiny_model, tmp_path) -> None:
    write_batches(tmp_path / "batches")
    # side by side (independent runs): their start-up is mostly single-threaded imports, which left a core idle
    # when they ran one after the other
    runs = {n: start_replay(tiny_model, tmp_path / "batches", tmp_path / str(n), n) for n in (1, 2)}
    try:
        one, two = (trained(runs[n], tmp_path / str(n)) for n in (1, 2))
    finally:
        for proc in runs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert one.keys() == two.keys()
    assert any(v.abs().sum() > 0 for k, v in one.items() if "lora_B" in k)
    for k in one:  # summation order differs across ranks; an update without the all-reduce is ~1e-3 off
        torch.testing.assert_close(two[k], one[k], rtol=1e-3, atol=2e-5)
