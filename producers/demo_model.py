"""The demo's model: the tiny random model of ``streamrl.tiny_model`` with a sharper output distribution.

Why sharper: a freshly initialised model's logits are ``final_norm(h) · embedding``; with RMSNorm weight
1 and embeddings of std 0.02 they are bounded by about sqrt(hidden) · |e| ≈ 2.6 for the tiny shape, so
the output is nearly uniform and no LoRA adapter (which does not touch the norm) can concentrate it
(docs/loop.md, "The demo model"). Real models are peaked. Scaling the final norm weight by ``sharpness`` widens the logit range the same way as
sampling at temperature 1/sharpness, but keeps the sampling temperature at 1, so the logprobs vLLM
reports and the trainer recomputes describe the same distribution.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

DEFAULT_SHARPNESS = 6.0
MARKER = "streamrl-demo-model.json"


def build_demo_model(out_dir: str | Path, *, sharpness: float = DEFAULT_SHARPNESS, seed: int = 0,
                     shape: str = "tiny", vocab_size: int | None = None, dtype: str = "float32") -> Path:
    """Write the demo model to ``out_dir`` (built in a sibling temp dir, then renamed: never half-written).
    Reuses an existing build with the same settings.

    ``shape`` picks the layer sizes (``streamrl.tiny_model.SHAPES``; real shapes for the GPU runs, with
    ``vocab_size`` usually cut to the local tokenizer's 2048). The logit range of a random model grows
    with sqrt(hidden), so ``sharpness`` is given for the tiny shape's hidden size (128) and scaled by
    sqrt(128 / hidden) for the others: every shape starts from about the same output distribution."""
    from safetensors.torch import load_file, save_file

    from streamrl.tiny_model import CHAT_TEMPLATE, SHAPES, build_model

    out = Path(out_dir)
    # the chat template's digest too: a build cached under an older template is built again
    template = hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest()[:16]
    settings = {"shape": shape, "sharpness": sharpness, "seed": seed, "vocab_size": vocab_size, "dtype": dtype,
                "template": template}
    marker = out / MARKER
    if marker.exists() and json.loads(marker.read_text()) == settings:
        return out
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    build_model(tmp, shape, seed=seed, vocab_size=vocab_size, dtype=dtype)
    scale = sharpness * (128 / int(SHAPES[shape]["hidden_size"])) ** 0.5
    index = tmp / "model.safetensors.index.json"
    weights = tmp / (json.loads(index.read_text())["weight_map"]["model.norm.weight"] if index.exists()
                     else "model.safetensors")
    tensors = load_file(weights)
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * scale
    save_file(tensors, weights, metadata={"format": "pt"})
    (tmp / MARKER).write_text(json.dumps(settings))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp.rename(out)
    return out


def default_cache_dir() -> Path:
    """Where ``streamrl up`` keeps the demo model: $STREAMRL_CACHE or ~/.cache/streamrl."""
    return Path(os.environ.get("STREAMRL_CACHE", Path.home() / ".cache" / "streamrl"))
