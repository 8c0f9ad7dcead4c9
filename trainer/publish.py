"""Publish adapter versions: atomic directory, weights hash, policy record, bounded history on disk.

``<adapters>/<name>/v<N>/`` holds ``adapter_config.json`` and ``adapter_model.safetensors`` (peft's
format, which vLLM's runtime LoRA loading reads; the weights in the base model's dtype, see
:func:`serving_weights`) plus ``streamrl_trainer.json`` (version, step and the
ids of the groups this version was trained on). It is written under a temporary name and renamed, so
a reader never sees a half-written version. The last ``keep`` version directories stay on disk because
a serving engine may still read them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from peft import PeftModel

from streamrl.broker.schema import WEIGHTS_FILE, sha256_file

META_FILE = "streamrl_trainer.json"
_VERSION_DIR = re.compile(r"^v(\d+)$")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def serving_weights(model: PeftModel) -> dict[str, torch.Tensor]:
    """The adapter's weights in the base model's dtype, for peft's ``save_pretrained(state_dict=...)``.

    The optimizer keeps them in fp32, but vLLM casts a runtime LoRA to its model's dtype on load (and the
    trainer itself computes under bf16 autocast on a bf16 base), so fp32 on disk would only double the bytes
    the trainer writes, every gateway hashes and every engine reads while serving: publish -> served."""
    dtype = model.get_base_model().dtype
    return {k: v.detach().to(dtype) for k, v in model.state_dict().items() if "lora_" in k}


def write_adapter(model: PeftModel, policy_dir: Path, version: int, meta: dict) -> tuple[Path, str]:
    """Write version ``version`` atomically; returns its directory and the sha256 of its weights.

    A directory of that version left by a crash before its checkpoint was written is replaced: no
    policy record was ever published for it (records go out only after the checkpoint).
    """
    policy_dir.mkdir(parents=True, exist_ok=True)
    final = policy_dir / f"v{version}"
    tmp = policy_dir / f".tmp-v{version}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True, state_dict=serving_weights(model))
    (tmp / META_FILE).write_text(json.dumps({"version": version, **meta}))
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(policy_dir)
    return final, sha256_file(final / WEIGHTS_FILE)


def version_dirs(policy_dir: Path) -> dict[int, Path]:
    if not policy_dir.is_dir():
        return {}
    return {int(m.group(1)): p for p in policy_dir.iterdir() if (m := _VERSION_DIR.match(p.name))}


def prune(policy_dir: Path, keep: int) -> None:
    """Delete all but the newest ``keep`` version directories (and stray temp directories)."""
    dirs = version_dirs(policy_dir)
    for v in sorted(dirs)[:-keep] if keep > 0 else []:
        shutil.rmtree(dirs[v], ignore_errors=True)
    for p in policy_dir.glob(".tmp-v*"):
        if not p.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(p, ignore_errors=True)
