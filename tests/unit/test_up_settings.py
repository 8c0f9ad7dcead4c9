"""The trainer's and the demo's settings in ``streamrl up`` follow the model: demo defaults < the model's own
settings < the [trainer] / [demo] tables < flags; no servers started."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from streamrl.cli.up import Stack
from streamrl.cli.up_config import DemoTrainer, check_lora_slots, load_config
from streamrl.engine.lora_slots import lora_slots
from streamrl.packaged_models import (
    MODELS,
    REAL_MODEL_SETTINGS,
    TINY_MODEL_PARAMETERS,
    parameter_count,
    settings_for,
)
from streamrl.usage import UsageError

SMOLLM2 = MODELS["smollm2-135m"].settings
assert SMOLLM2 is not None


def checkpoint(d: Path, hidden: int, layers: int, inter: int, vocab: int) -> str:
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"hidden_size": hidden, "num_hidden_layers": layers,
                                               "intermediate_size": inter, "vocab_size": vocab}))
    return str(d)


def test_a_packaged_model_brings_its_own_settings(tmp_path: Path) -> None:
    c = load_config(None, model="smollm2-135m", demo=True, demo_task="arithmetic", work_dir=str(tmp_path))
    t = c.trainer_config("/m", "b:1")
    assert (t.optim.learning_rate, t.lora.rank, t.feed.group_size, t.feed.groups_per_step) == (
        SMOLLM2.learning_rate, SMOLLM2.lora_rank, SMOLLM2.group_size, SMOLLM2.groups_per_step)
    assert t.optim.learning_rate < DemoTrainer().learning_rate / 10  # not the tiny model's
    assert t.feed.max_lag == DemoTrainer().max_lag  # what the model does not say stays the demo's
    assert c.demo is not None and (c.demo.max_tokens, c.demo.temperature) == (SMOLLM2.max_tokens, SMOLLM2.temperature)
    sources = c.trainer_settings()
    assert sources["learning_rate"] == (SMOLLM2.learning_rate, "model smollm2-135m")
    assert sources["max_lag"] == (DemoTrainer().max_lag, "demo default")


def test_the_table_then_the_flags_win_over_the_model(tmp_path: Path) -> None:
    path = tmp_path / "up.toml"
    path.write_text("[trainer.optim]\nlearning_rate = 1e-5\n[trainer.lora]\nrank = 4\n[demo]\nmax_tokens = 64\n")
    c = load_config(path, model="smollm2-135m", demo=True, work_dir=str(tmp_path),
                    trainer__lora_rank=16, demo_temperature=0.7)
    t = c.trainer_config("/m", "b:1")
    assert (t.optim.learning_rate, t.lora.rank, t.feed.group_size) == (1e-5, 16, SMOLLM2.group_size)
    assert c.trainer_settings()["learning_rate"] == (1e-5, "[trainer] table")
    assert c.trainer_settings()["lora_rank"] == (16, "--trainer flag")
    assert c.demo is not None and (c.demo.max_tokens, c.demo.temperature) == (64, 0.7)


def test_a_real_checkpoint_by_path_gets_real_model_settings(tmp_path: Path) -> None:
    real = checkpoint(tmp_path / "real", hidden=576, layers=30, inter=1536, vocab=49152)  # SmolLM2-135M's shape
    assert parameter_count(Path(real)) > TINY_MODEL_PARAMETERS
    assert settings_for(real) == REAL_MODEL_SETTINGS
    c = load_config(None, model=real, demo=True, work_dir=str(tmp_path / "run"))
    assert c.trainer_config(real, "b:1").optim.learning_rate == REAL_MODEL_SETTINGS.learning_rate
    assert c.trainer_settings()["learning_rate"][1] == "real-model default"
    without_demo = load_config(None, model=real, work_dir=str(tmp_path / "run"))  # not only with --demo
    assert without_demo.trainer_config(real, "b:1").optim.learning_rate == REAL_MODEL_SETTINGS.learning_rate


def test_a_tiny_checkpoint_keeps_the_demo_defaults(tmp_path: Path) -> None:
    tiny = checkpoint(tmp_path / "tiny", hidden=128, layers=2, inter=256, vocab=2048)  # the test model's shape
    assert settings_for(tiny) is None and settings_for(None) is None and settings_for("org/unknown") is None
    c = load_config(None, model=tiny, demo=True, work_dir=str(tmp_path / "run"))
    assert c.trainer_config(tiny, "b:1").optim.learning_rate == DemoTrainer().learning_rate


def test_several_policies_get_a_trainer_each_and_lora_slots_for_all(tmp_path: Path) -> None:
    """``up --policies support,sql``: the gateway serves both, each trainer has its own name, adapters, history,
    consumer group and metrics port, and the engine's LoRA slots hold every policy's loaded versions."""
    c = load_config(None, policies=["support,sql"], work_dir=str(tmp_path))
    assert c.policy_names == ("policy", "support", "sql")
    gateway = c.gateway_config(["http://127.0.0.1:1"], "b:1", 1)
    assert gateway.policy_names == c.policy_names
    trainers = [c.trainer_config("/m", "b:1", name) for name in c.policy_names]
    assert [t.name for t in trainers] == list(c.policy_names)
    assert [t.adapters for t in trainers] == [str(tmp_path / "adapters" / n) for n in c.policy_names]
    assert len({t.history for t in trainers}) == len({t.group_id for t in trainers}) == 3
    assert len({t.metrics_port for t in trainers}) == 3
    engine = c.engine_config("/m", gateway.max_loaded_versions)
    assert (engine.max_loras, engine.max_cpu_loras) == lora_slots(3, 3) == (9, 9)
    check_lora_slots(engine, 3, 3)
    one = load_config(None, work_dir=str(tmp_path))  # one policy: the layout and slots it always had
    assert one.trainer_config("/m", "b:1").adapters == str(tmp_path / "adapters")
    assert (one.engine_config("/m").max_loras, one.engine_config("/m").max_cpu_loras) == (4, 8)


def test_lora_slots_too_few_for_the_policies_are_a_usage_error(tmp_path: Path) -> None:
    c = load_config(None, policies=["a", "b", "c", "d"], work_dir=str(tmp_path), engine_max_cpu_loras=8)
    engine = c.engine_config("/m", 3)
    assert engine.max_cpu_loras == 8 and engine.max_loras == 15  # the table's CPU cache; GPU slots sized
    with pytest.raises(UsageError, match="max_cpu_loras = 8 holds fewer adapters than the 15 versions"):
        check_lora_slots(engine, 5, 3)
    with pytest.raises(UsageError, match="max_loras = 2 is fewer GPU LoRA slots than the 5 policies"):
        check_lora_slots(dataclasses.replace(engine, max_loras=2, max_cpu_loras=15), 5, 3)
    with pytest.raises(UsageError, match=r"\[gateway\] policies is set by up"):
        (tmp_path / "up.toml").write_text('[gateway]\npolicies = ["x"]\n')
        Stack(load_config(tmp_path / "up.toml", work_dir=str(tmp_path))).preflight()


def test_in_flight_updates_without_token_capture_are_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"\[gateway\]: update_mode 'in-flight' needs token_capture"):
        Stack(load_config(None, work_dir=str(tmp_path), update_mode="in-flight", token_capture=False)).preflight()
