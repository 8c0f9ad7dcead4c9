"""Trainer configuration: defaults, then a TOML/JSON file, then flags; unknown keys are refused."""

from __future__ import annotations

import json
import os

import pytest

from streamrl.cli import build_parser
from streamrl.trainer.cli import config_from_args
from streamrl.trainer.config import TrainerConfig


def test_file_then_flags(tmp_path) -> None:
    path = tmp_path / "trainer.toml"
    path.write_text('[trainer]\nlearning_rate = 0.004\ngroups_per_step = 3\nis_mode = "ppo_clip"\n'
                    'target_modules = ["q_proj", "v_proj"]\n')
    parser, _ = build_parser()
    args = parser.parse_args(["trainer", "--model", "m", "--bootstrap-servers", "h:1", "--adapters", "a",
                              "--config", str(path), "--groups-per-step", "5", "--name", "pol"])
    c = config_from_args(args)
    assert (c.learning_rate, c.groups_per_step, c.is_mode, c.name) == (0.004, 5, "ppo_clip", "pol")
    assert c.target_modules == ("q_proj", "v_proj") and c.group_size == TrainerConfig().group_size
    assert "learning_rate = 0.004" in c.describe()


def test_json_and_bad_values(tmp_path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"lora_rank": 4}))
    assert TrainerConfig.load(path, model="m").lora_rank == 4
    path.write_text(json.dumps({"lora_rnak": 4}))
    with pytest.raises(ValueError, match="lora_rnak"):
        TrainerConfig.load(path)
    with pytest.raises(ValueError, match="is_mode"):
        TrainerConfig(is_mode="nope")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cpu_threads"):
        TrainerConfig(cpu_threads=-1)


def test_cpu_threads_leave_the_engine_its_cores() -> None:
    from streamrl.trainer.daemon import cpu_threads

    assert cpu_threads(TrainerConfig(cpu_threads=3)) == 3
    assert cpu_threads(TrainerConfig()) == max(1, len(os.sched_getaffinity(0)) // 2)
    parser, _ = build_parser()
    args = parser.parse_args(["trainer", "--model", "m", "--bootstrap-servers", "h:1", "--adapters", "a",
                              "--cpu-threads", "2"])
    assert config_from_args(args).cpu_threads == 2


def test_asdict_json_round_trip(tmp_path) -> None:
    """`streamrl up` hands the trainer its effective config as JSON of dataclasses.asdict."""
    import dataclasses

    c = TrainerConfig(model="m", adapters="a", metrics_port=9100, kl_coef=0.1)
    path = tmp_path / "trainer.json"
    path.write_text(json.dumps(dataclasses.asdict(c)))
    assert TrainerConfig.load(path) == c
