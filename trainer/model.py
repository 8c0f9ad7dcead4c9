"""The policy: a base causal LM with a peft LoRA adapter, and logprobs over packed sequences.

Sequences are packed into one row (batch 1) with ``position_ids`` restarting at 0 for each sequence;
transformers turns that into a block-diagonal causal mask (or flash-attention varlen), so packed
sequences never attend to each other and no padding is needed. Logprobs are computed only at the
positions of sampled tokens, in chunks, each chunk's logits recomputed in the backward pass instead of
kept (``torch.utils.checkpoint``): a 150k vocabulary never materialises more than ``chunk`` rows of
fp32 logits.

With ``compile`` the decoder layers are compiled one by one (regional compilation, see
``compile_layers``) and the target-logprob head too, never the whole body: one layer's graph serves
all layers, so the warm-up costs one layer's compile.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from torch.utils.checkpoint import checkpoint

from .config import TrainerConfig


def pick_device(device: str) -> torch.device:
    """``auto``: the first CUDA device when available, else the CPU (same code either way)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


_LOADING = threading.Lock()
"""One model load at a time per process: transformers builds a model on torch's meta device by switching module
initialisation globally, so two trainers loading at once in one process (threads) can get each other's empty
weights ("Cannot copy out of meta tensor")."""


def load_policy(config: TrainerConfig, device: torch.device) -> PeftModel:
    """Base model (bf16 on CUDA, fp32 on CPU) with a fresh LoRA adapter; only the adapter trains."""
    from transformers import AutoModelForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with _LOADING:
        base = AutoModelForCausalLM.from_pretrained(config.model, dtype=dtype,
                                                    attn_implementation=config.compute.attn_implementation)
        model = attach_lora(base.to(device), config)
    if config.lora.init_adapter:
        load_adapter_weights(model, config.lora.init_adapter)
    return model


def load_adapter_weights(model: PeftModel, directory: str) -> None:
    """Set the LoRA weights from a saved peft adapter (``init_adapter``). Its ``lora_B`` are rescaled from
    the saved scaling (``lora_alpha / r``; 1 in what ``publish.py`` writes, which folds it into ``lora_B``)
    to this model's, so the adapter computes the same function under the trainer's ``lora_alpha``."""
    import json
    import math
    from pathlib import Path

    from peft import set_peft_model_state_dict
    from peft.tuners.lora import LoraLayer
    from safetensors.torch import load_file

    path = Path(directory)
    saved = json.loads((path / "adapter_config.json").read_text())
    ours = model.peft_config[model.active_adapter]
    if saved.get("r") != ours.r:
        raise ValueError(f"init_adapter {path}: rank {saved.get('r')}, but lora_rank is {ours.r}")
    saved_scale = saved["lora_alpha"] / (math.sqrt(saved["r"]) if saved.get("use_rslora") else saved["r"])
    scales = {name: float(m.scaling[model.active_adapter]) for name, m in model.named_modules()
              if isinstance(m, LoraLayer) and model.active_adapter in m.scaling}
    weights = {}
    for key, value in load_file(path / "adapter_model.safetensors").items():
        if ".lora_B." in key:
            value = value.float() * saved_scale / scales[key.split(".lora_B.")[0]]
        weights[key] = value.float()
    result = set_peft_model_state_dict(model, weights)
    lora_missing = [k for k in result.missing_keys if "lora_" in k]
    if result.unexpected_keys or lora_missing:
        raise ValueError(f"init_adapter {path}: its modules do not match target_modules "
                         f"(unexpected {result.unexpected_keys[:3]}, missing {lora_missing[:3]})")


def attach_lora(base: torch.nn.Module, config: TrainerConfig) -> PeftModel:
    """Wrap a causal LM with the configured LoRA adapter (optionally compiling its decoder layers)."""
    lora = LoraConfig(r=config.lora.rank, lora_alpha=config.lora.alpha, lora_dropout=config.lora.dropout,
                      target_modules=list(config.lora.target_modules), bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(base, lora)  # adapter weights in fp32 (peft's default), optimizer states too
    model.config.use_cache = False
    if next(base.parameters()).dtype == torch.bfloat16:
        # packed_logprobs runs the body under bf16 autocast: peft need not cast inputs to fp32 copies
        for module in model.modules():
            if isinstance(module, BaseTunerLayer):
                module.cast_input_dtype_enabled = False
    if config.compute.compile:
        compile_layers(model, dynamic=config.compute.compile != "static")
    return model


def compile_layers(model: PeftModel, *, dynamic: bool = True) -> None:
    """Regional compilation: ``torch.compile`` each decoder layer in place (``Module.compile``, so
    parameter names and saved adapters are unchanged). All layers run the same code with their own
    parameters as graph inputs (dynamo's default ``inline_inbuilt_nn_modules``), so one compiled graph
    serves every layer and the warm-up is one layer's compile, not the whole body's.

    ``dynamic``: rows and length symbolic from the first compile (``dynamic=True``): packed rows of
    any length then share a graph; otherwise specialised to the first shapes (``dynamic=None``).
    """
    causal_lm = model.get_base_model()
    # the first layer's input is the frozen embedding's output; made to require grad like every other
    # layer's input, the first layer shares their graph instead of needing one of its own
    causal_lm.enable_input_require_grads()
    for layer in causal_lm.model.layers:
        layer.compile(dynamic=True if dynamic else None)


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _target_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                     temperatures: torch.Tensor | None = None) -> torch.Tensor:
    # one fused log-softmax with fp32 output, then the targets' entries (no logsumexp composite)
    logits = torch.nn.functional.linear(hidden, weight)
    if temperatures is not None:  # the distribution vLLM sampled from: logits / T (in fp32)
        logits = logits.float() / temperatures.to(device=logits.device, dtype=torch.float32)[:, None]
    return torch.log_softmax(logits, -1, dtype=torch.float32).gather(-1, targets[:, None]).squeeze(-1)


@functools.cache
def _compiled_target_logprobs() -> Callable:
    """Log-softmax and gather fused: no (chunk x vocab) fp32 tensor is written in the forward pass nor
    read in the backward pass. The number of targets is the only size that varies (marked dynamic
    where it is called)."""
    return torch.compile(_target_logprobs)


def packed_logprobs(model: PeftModel, input_ids: torch.Tensor, position_ids: torch.Tensor,
                    target_positions: torch.Tensor, *, temperatures: torch.Tensor | None = None,
                    chunk: int = 1024, recompute: bool = True, compiled_head: bool = False) -> torch.Tensor:
    """Logprob of each target token given the tokens before it within its own sequence, under the
    distribution softmax(logits / temperature) (``temperatures``: one per target; None = 1).

    ``input_ids`` and ``position_ids`` are (R, T) packed rows; ``target_positions`` are flat indices
    ``row * T + column`` (never column 0 of a sequence: a sampled token always has a prompt before it).
    Logits exist only for the targets, ``chunk`` rows at a time; with ``recompute`` a chunk's logits
    are recomputed in the backward pass instead of kept (saves memory, costs one more lm_head matmul).
    ``compiled_head``: the logits-to-logprobs head runs compiled (see ``ComputeConfig.compile``).
    """
    causal_lm = model.get_base_model()
    weight = causal_lm.get_output_embeddings().weight
    # bf16 base with fp32 adapter weights: autocast runs the small LoRA matmuls in bf16 on bf16 inputs
    # instead of peft casting every layer's input to fp32 (see attach_lora)
    mixed = weight.dtype == torch.bfloat16
    with torch.autocast(input_ids.device.type, dtype=torch.bfloat16) if mixed else contextlib.nullcontext():
        hidden = causal_lm.model(input_ids=input_ids, position_ids=position_ids).last_hidden_state
    hidden = hidden.reshape(-1, hidden.shape[-1])
    h = hidden.index_select(0, target_positions - 1)
    targets = input_ids.reshape(-1).index_select(0, target_positions)
    head = _compiled_target_logprobs() if compiled_head else _target_logprobs
    parts = []
    for i in range(0, h.shape[0], chunk):
        hs, ts = h[i:i + chunk], targets[i:i + chunk]
        temps = None if temperatures is None else temperatures[i:i + chunk]
        if compiled_head:  # chunk sizes vary (the last one): one graph for all of them
            for t in (hs, ts) if temps is None else (hs, ts, temps):
                torch._dynamo.maybe_mark_dynamic(t, 0)
        if recompute and torch.is_grad_enabled():
            parts.append(checkpoint(head, hs, weight, ts, temps, use_reentrant=False))
        else:
            parts.append(head(hs, weight, ts, temps))
    return torch.cat(parts) if parts else hidden.new_zeros(0, dtype=torch.float32)


@torch.no_grad()
def packed_predictions(model: PeftModel, input_ids: torch.Tensor, position_ids: torch.Tensor,
                       target_positions: torch.Tensor, *, chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Evaluation's view of the targets (see ``packed_logprobs`` for the layout): each target's logprob and
    whether it is the model's most likely token (token accuracy, which needs the whole vocabulary's logits,
    so it is not folded into the training path). No gradient; ``chunk`` targets' logits at a time."""
    causal_lm = model.get_base_model()
    weight = causal_lm.get_output_embeddings().weight
    mixed = weight.dtype == torch.bfloat16
    with torch.autocast(input_ids.device.type, dtype=torch.bfloat16) if mixed else contextlib.nullcontext():
        hidden = causal_lm.model(input_ids=input_ids, position_ids=position_ids).last_hidden_state
    h = hidden.reshape(-1, hidden.shape[-1]).index_select(0, target_positions - 1)
    targets = input_ids.reshape(-1).index_select(0, target_positions)
    logps, hits = [], []
    for i in range(0, h.shape[0], chunk):
        logits = torch.nn.functional.linear(h[i:i + chunk], weight).float()
        ts = targets[i:i + chunk]
        logps.append(torch.log_softmax(logits, -1).gather(-1, ts[:, None]).squeeze(-1))
        hits.append(logits.argmax(-1) == ts)
    if not logps:
        return h.new_zeros(0, dtype=torch.float32), torch.zeros(0, dtype=torch.bool, device=h.device)
    return torch.cat(logps), torch.cat(hits)
