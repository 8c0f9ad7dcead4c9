"""What ``engine/lora_slots.py`` sizes GPU LoRA slots for, held against vLLM's own scheduler (the real class of
the installed release, driven step by step in this process; no server, no model weights): a waiting request whose
adapter no running request uses starts only while the running requests use fewer than ``max_loras`` adapters. Under
long replies pinned requests keep every loaded version of a policy running, so an engine with fewer slots than
loaded versions makes a newly routed version's first requests wait behind an older version's last reply."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from streamrl.engine.lora_slots import lora_slots

STEPS = 3
"""Decode steps a waiting request is watched for (the long replies run on through all of them)."""


def scheduler(model: Path, max_loras: int) -> Any:
    """vLLM's V1 scheduler for ``model``'s config with LoRA on, ``max_loras`` GPU slots and room for a few requests."""
    import torch
    from vllm.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    cache = CacheConfig(block_size=16)
    cache.num_gpu_blocks = 64
    config = VllmConfig(model_config=ModelConfig(model=str(model), max_model_len=256),
                        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256,
                                                         max_model_len=256, is_encoder_decoder=False),
                        cache_config=cache, lora_config=LoRAConfig(max_loras=max_loras, max_cpu_loras=8))
    spec = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    return Scheduler(vllm_config=config, kv_cache_config=kv, log_stats=False, block_size=16,
                     structured_output_manager=StructuredOutputManager(config))


def request(request_id: str, adapter: int) -> Any:
    """A request on adapter ``adapter`` (a policy's version) with a long reply ahead of it."""
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(request_id=request_id, prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(max_tokens=200),
                   pooling_params=None, lora_request=LoRARequest(f"adapter-{adapter}", adapter, "/unused"))


def step(sched: Any) -> set[str]:
    """One engine step: what the scheduler runs, each request then given one sampled token. Returns the ids run."""
    from vllm.v1.outputs import ModelRunnerOutput

    out = sched.schedule()
    ids = sorted(out.num_scheduled_tokens)
    sched.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                    sampled_token_ids=[[5] for _ in ids]))
    return set(ids)


def new_version_waits(model: Path, max_loras: int, running: int) -> bool:
    """Long replies running on ``running`` adapters (pinned requests on older versions), then a request on another
    (a newly routed version): does it wait through ``STEPS`` steps while the others run on?"""
    sched = scheduler(model, max_loras)
    older = {f"old-{a}" for a in range(1, running + 1)}
    for a in range(1, running + 1):
        sched.add_request(request(f"old-{a}", a))
    assert step(sched) == older
    sched.add_request(request("new", running + 1))
    ran = [step(sched) for _ in range(STEPS)]
    assert all(older <= s for s in ran), "the long replies run on in every step"
    return not any("new" in s for s in ran)


@pytest.mark.parametrize("policies", [1, 2])
def test_slots_for_every_loaded_version_let_a_new_version_start_beside_long_replies(tiny_model: Path,
                                                                                    policies: int) -> None:
    """Each policy at the gateway's default room (3): its routed version, the one kept before it and the next; under
    long replies the two older ones of every policy still run when a policy's new version is routed."""
    room = 3
    gpu, cpu = lora_slots(policies, room)
    assert gpu == cpu == policies * room
    running = policies * (room - 1)
    assert not new_version_waits(tiny_model, max_loras=gpu, running=running)
    assert new_version_waits(tiny_model, max_loras=2 * policies, running=running), \
        "two slots a policy (the sizing before): vLLM holds the new version's request back"
