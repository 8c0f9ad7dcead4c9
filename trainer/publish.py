"""Publish adapter versions: atomic directory, weights hash, policy record, bounded history on disk.

``<adapters>/<name>/v<N>/`` holds ``adapter_config.json`` and ``adapter_model.safetensors`` (peft's
format, which vLLM's runtime LoRA loading reads; the weights in the base model's dtype with the scaling
folded into ``lora_B``, see :func:`serving_weights`) plus ``streamrl_trainer.json`` (version, step and the
ids of the groups this version was trained on). It is written under a temporary name and renamed, so
a reader never sees a half-written version. The last ``keep`` version directories stay on disk because
a serving engine may still read them.
"""

from __future__ import annotations

import json
import math
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
    """The adapter's weights in the base model's dtype, for peft's ``save_pretrained(state_dict=...)``, with
    each layer's scaling (``lora_alpha / r``) folded into its ``lora_B`` (the config is then saved with
    scaling 1: :func:`_unit_scaling_config`).

    The optimizer keeps them in fp32, but vLLM casts a runtime LoRA to its model's dtype on load (and the
    trainer itself computes under bf16 autocast on a bf16 base), so fp32 on disk would only double the bytes
    the trainer writes, every gateway hashes and every engine reads while serving: publish -> served. The
    scaling: vLLM multiplies every ``lora_B`` of a loaded adapter by it, on the CPU in the engine core's thread,
    while generation waits (``LoRALayerWeights.optimize``: on one H200 beside a trainer, about a third of a
    load's samples in py-spy; docs/benchmarks.md); with scaling 1 it skips the multiply."""
    config = model.peft_config[model.active_adapter]
    if config.rank_pattern or config.alpha_pattern:  # one lora_alpha = r in the config could not undo them
        raise ValueError("per-module ranks or alphas (rank_pattern / alpha_pattern) are not published")
    dtype = model.get_base_model().dtype
    scales = _b_scales(model)
    return {k: (v.detach() * scales[k] if k in scales else v.detach()).to(dtype)
            for k, v in model.state_dict().items() if "lora_" in k}


def _b_scales(model: PeftModel) -> dict[str, float]:
    """``state_dict`` key of each ``lora_B`` weight -> that layer's scaling."""
    from peft.tuners.lora import LoraLayer

    adapter = model.active_adapter
    return {f"{name}.lora_B.{adapter}.weight": float(module.scaling[adapter])
            for name, module in model.named_modules() if isinstance(module, LoraLayer) and adapter in module.scaling}


def _unit_scaling_config(path: Path) -> None:
    """Rewrite the saved ``adapter_config.json`` so that its scaling is 1 (``lora_alpha`` = r, or sqrt(r) with
    rsLoRA): the scaling is in ``lora_B`` already (:func:`serving_weights`)."""
    config_file = path / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["lora_alpha"] = math.sqrt(config["r"]) if config.get("use_rslora") else config["r"]
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True))


def write_adapter(model: PeftModel, policy_dir: Path, version: int, meta: dict) -> tuple[Path, str]:
    """Write version ``version`` atomically; returns its directory and the sha256 of its weights.

    A directory of that version left by a crash before its checkpoint was written is replaced: no
    policy record was ever published for it (records go out only after the checkpoint).
    """
    policy_dir.mkdir(parents=True, exist_ok=True)
    final = policy_dir / f"v{version}"
    tmp = policy_dir / f".tmp-v{version}-{os.getpid()}"
    _save_serving(model, tmp, {"version": version, **meta})
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(policy_dir)
    return final, sha256_file(final / WEIGHTS_FILE)


def _save_serving(model: PeftModel, tmp: Path, meta: dict) -> None:
    """The serving adapter (``serving_weights``, unit scaling) and its meta file in ``tmp``, fsynced."""
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True, state_dict=serving_weights(model))
    _unit_scaling_config(tmp)
    (tmp / META_FILE).write_text(json.dumps(meta))
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())


def write_adapter_files(model: PeftModel, directory: Path, meta: dict) -> str:
    """The adapter's files written straight into ``directory`` (``streamrl sft --out DIR``, which also holds
    a checkpoint, so the directory itself cannot be swapped): each file written aside and renamed over the
    old one. Returns the sha256 of the weights."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".tmp-adapter-{os.getpid()}"
    _save_serving(model, tmp, meta)
    for f in sorted(tmp.iterdir(), key=lambda f: f.name == WEIGHTS_FILE):  # weights last: a reader who sees
        os.replace(f, directory / f.name)  # the new weights sees their config too
    tmp.rmdir()
    _fsync_dir(directory)
    return sha256_file(directory / WEIGHTS_FILE)


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
