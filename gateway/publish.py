"""Publish an adapter directory as a policy version by hand (the trainer does this itself).

Useful to roll back to an older adapter, to serve an adapter trained elsewhere, and for the hot-swap
tests and benchmark. ``random_adapter`` writes a LoRA adapter with random weights for those.
"""

from __future__ import annotations

import time
from pathlib import Path

from kafka import KafkaProducer

from streamrl.broker.clients import make_producer
from streamrl.broker.schema import WEIGHTS_FILE, PolicyRecord, encode, sha256_file
from streamrl.broker.topics import Topics


def publish_version(bootstrap_servers: str, topics: Topics, name: str, version: int, path: Path,
                    base_model: str, *, step: int = 0, metrics: dict[str, float] | None = None,
                    producer: KafkaProducer | None = None) -> PolicyRecord:
    """Write the policy record of ``path`` (sha256 of its weights file computed here) and wait for the
    broker's acknowledgement. Pass a long-lived ``producer`` when publishing often."""
    record = PolicyRecord(name=name, version=version, path=str(path), base_model=base_model, step=step,
                          sha256=sha256_file(Path(path) / WEIGHTS_FILE), metrics=metrics or {})
    own = producer is None
    producer = producer or make_producer(bootstrap_servers)
    try:
        record.created = time.time()
        producer.send(topics.policy, key=name.encode(), value=encode(record)).get(timeout=30)
    finally:
        if own:
            producer.close()
    return record


def random_adapter(model_dir: Path, out_dir: Path, *, seed: int, rank: int = 8, scale: float = 0.5) -> Path:
    """A LoRA adapter (q_proj, v_proj) on ``model_dir`` whose B matrices are random, so that each seed
    changes the model's outputs. Written with peft, loadable by vLLM."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for pname, param in peft_model.named_parameters():
            if "lora_B" in pname:
                param.normal_(0.0, scale)
    peft_model.save_pretrained(out_dir)
    return Path(out_dir)
