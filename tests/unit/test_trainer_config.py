"""Trainer configuration: defaults, then a TOML/JSON file (its concerns in nested tables), then flags (flat, as
they always were); unknown keys are refused, a flat key written where a table belongs says which table."""

from __future__ import annotations

import json
import os

import pytest

from streamrl.cli import build_parser
from streamrl.config_file import ConfigError
from streamrl.trainer.cli import config_from_args
from streamrl.trainer.config import FeedConfig, LossConfig, TrainerConfig
from streamrl.trainer.divergence import DivergenceThresholds


def test_file_then_flags(tmp_path) -> None:
    """Nested tables in the file, flags (flat, as they always were) over them: a flag changes one setting of a
    table and keeps the file's others."""
    path = tmp_path / "trainer.toml"
    path.write_text('[trainer]\nseed = 3\n[trainer.optim]\nlearning_rate = 0.004\n[trainer.feed]\ngroups_per_step = 3\n'
                    '[trainer.loss]\nis_mode = "ppo_clip"\n[trainer.lora]\nrank = 16\nalpha = 8\n'
                    'target_modules = ["q_proj", "v_proj"]\n')
    parser, _ = build_parser()
    args = parser.parse_args(["trainer", "--model", "m", "--bootstrap-servers", "h:1", "--adapters", "a",
                              "--config", str(path), "--groups-per-step", "5", "--name", "pol", "--lora-alpha", "4"])
    c = config_from_args(args)
    assert (c.optim.learning_rate, c.feed.groups_per_step, c.loss.is_mode, c.name, c.seed) == (
        0.004, 5, "ppo_clip", "pol", 3)
    assert (c.lora.rank, c.lora.alpha, c.lora.target_modules) == (16, 4.0, ("q_proj", "v_proj"))
    assert c.feed.group_size == FeedConfig().group_size and c.feed.max_ready_groups == 5 * (4 + 1)


def test_load_takes_the_flags_flat_names(tmp_path) -> None:
    """``load``'s overrides are the flags' names, routed into their tables (over the file's), as ``streamrl up``
    and the tests give them."""
    c = TrainerConfig.load(None, model="m", lora_rank=4, learning_rate=0.1, divergence_kl=2.0, publish_every=3,
                           keep_versions=2, init_adapter="x", max_steps=7)
    assert (c.lora.rank, c.optim.learning_rate, c.divergence.kl, c.publish.every, c.publish.keep_versions) == (
        4, 0.1, 2.0, 3, 2)
    assert (c.lora.init_adapter, c.max_steps, c.divergence.window) == ("x", 7, DivergenceThresholds().window)
    path = tmp_path / "t.toml"
    path.write_text("[lora]\nalpha = 3\n")  # a file of the trainer alone: its tables at the top
    lora = TrainerConfig.load(path, lora_rank=4).lora
    assert (lora.rank, lora.alpha) == (4, 3.0)
    with pytest.raises(ConfigError, match="unknown option 'lora_rnak'"):
        TrainerConfig.load(None, lora_rnak=4)


MISPLACED = [  # a file, and the error it gets
    ("[trainer]\nmodel = 'm'\nlora_rank = 16\n",
     r"t.toml:3:1: unknown option 'lora_rank' in \[trainer\] \(did you mean \[trainer.lora\] rank\?\)"),
    ("[trainer]\nlearning_rate = 0.1\n", r"did you mean \[trainer.optim\] learning_rate\?"),
    ("[trainer.optim]\nlearning_rate = 0.1\n[trainer.lora]\nlearning_rate = 0.2\n",
     r"t.toml:4:1: unknown option 'learning_rate' in \[trainer.lora\] "
     r"\(the \[trainer.lora\] settings: rank, alpha, dropout, target_modules"),
    ("[trainer.lora]\nrnak = 16\n", r"unknown option 'rnak' in \[trainer.lora\] \(did you mean rank\?\)"),
    ("[trainer.lora]\nrank = 'big'\n", r"\[trainer.lora\] rank: expected a whole number"),
    ("[trainer]\nlora = 16\n", r"\[trainer\] lora: expected a table"),
]


@pytest.mark.parametrize(("text", "error"), MISPLACED)
def test_a_flat_key_in_the_trainer_table_names_its_table(tmp_path, text: str, error: str) -> None:
    """A setting that lives in a nested table, written at the ``[trainer]`` level by its flat name, is an error
    that says where it goes (no alias); a mistake inside a nested table names that table and its line."""
    path = tmp_path / "t.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=error):
        TrainerConfig.load(path)


def test_json_and_bad_values(tmp_path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"lora": {"rank": 4}}))
    assert TrainerConfig.load(path, model="m").lora.rank == 4
    path.write_text(json.dumps({"lora": {"rnak": 4}}))
    with pytest.raises(ValueError, match="rnak"):
        TrainerConfig.load(path)
    with pytest.raises(ValueError, match="is_mode"):
        TrainerConfig.load(None, is_mode="nope")
    with pytest.raises(ValueError, match=r"divergence\.window"):
        TrainerConfig.load(None, divergence_window=0)
    with pytest.raises(ValueError, match="cpu_threads"):
        TrainerConfig(cpu_threads=-1)


def test_describe_shows_the_tables_keys_dotted() -> None:
    """The effective configuration printed at start: one line per setting, a table's as ``table.key`` (what
    ``[trainer]`` would hold as TOML dotted keys), the Kafka password masked."""
    c = TrainerConfig.load(None, lora_rank=16, learning_rate=0.004,
                           kafka={"security_protocol": "SASL_SSL", "sasl_mechanism": "PLAIN",
                                  "sasl_username": "u", "sasl_password": "s3cret"})
    text = c.describe()
    assert "  lora.rank = 16\n" in text and "  optim.learning_rate = 0.004\n" in text
    assert "  feed.max_ready_groups = 10\n" in text and "  divergence.kl = 3.5\n" in text
    assert "  kafka.sasl_password = '***'" in text and "s3cret" not in text
    assert "lora_rank" not in text and "  model = ''" in text


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

    c = TrainerConfig(model="m", adapters="a", metrics_port=9100, loss=LossConfig(kl_coef=0.1))
    path = tmp_path / "trainer.json"
    path.write_text(json.dumps(dataclasses.asdict(c)))
    assert TrainerConfig.load(path) == c
