"""The LoRA load benchmark's own arithmetic: generation's pause during a load, and where a load's samples go."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from support.bench_module import load_bench


@pytest.fixture(scope="module")
def bench():
    return load_bench("lora_load_bench")


def test_pause_is_the_gap_a_load_makes(bench) -> None:
    """Tokens every 10 ms, none for 300 ms while the second of three loads runs: its pause is those 300 ms,
    the other loads' one step, and the windows between loads see one step too."""
    ticks = list(np.arange(0.0, 10.0, 0.01))
    arrivals = [t for t in ticks if not 5.0 < t < 5.3]
    loads = [(2.0, 2.05), (5.0, 5.3), (8.0, 8.05)]
    during, quiet = bench.pauses(arrivals, loads)
    assert during[1] == pytest.approx(300, abs=1)
    assert during[0] == pytest.approx(10, abs=1) and during[2] == pytest.approx(10, abs=1)
    assert len(quiet) == 2 and all(q == pytest.approx(10, abs=1) for q in quiet)


def test_add_lora_breakdown(bench, tmp_path: Path) -> None:
    """Samples are attributed to the deepest known part of a load; stacks outside ``add_lora`` (vLLM's LoRA
    kernels are named ``add_lora_linear``) only count towards the total."""
    raw = tmp_path / "stacks.txt"
    raw.write_text("\n".join([
        'process 1:"EngineCore";run_busy_loop (core.py:1);EngineCore.add_lora (core.py:2);'
        "Worker.add_lora (w.py:3);LRUCacheWorkerLoRAManager.add_adapter (m.py:4);"
        "WorkerLoRAManager._load_adapter (m.py:5);LoRAModel.from_local_checkpoint (l.py:6) 7",
        'process 1:"EngineCore";EngineCore.add_lora (core.py:2);LoRAModel.from_local_checkpoint (l.py:6);'
        "LoRAModel.from_lora_tensors (l.py:7) 4",
        'process 1:"EngineCore";EngineCore.add_lora (core.py:2);LRUCacheWorkerLoRAManager.add_adapter (m.py:4);'
        "LoRAModelManager._create_merged_loras_inplace (m.py:7);PackedLoRALayerWeights.pack (w.py:8);"
        "LoRALayerWeights.optimize (w.py:9) 5",
        'process 1:"EngineCore";EngineCore.add_lora (core.py:2);LRUCacheLoRAModelManager.activate_adapter (m.py:10);'
        "ColumnParallelLinearWithLoRA.set_lora (b.py:11) 3",
        'process 1:"EngineCore";EngineCore.add_lora (core.py:2);Tensor.pin_memory (t.py:12) 2',
        'process 1:"EngineCore";execute_model (r.py:1);add_lora_linear (p.py:2) 11',
        "not a stack line",
    ]))
    got = bench.add_lora_breakdown(raw)
    assert got["samples"] == 32 and got["in_add_lora"] == 21
    scale = "scale lora_B (none when the scaling is 1: trainer/publish.py folds it in)"
    assert got["parts"] == {"read files": 7, scale: 5, "cast and pin each tensor": 4, "copy into GPU slots": 3,
                            "pin host memory": 2}
