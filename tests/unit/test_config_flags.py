"""Every field of every part's configuration has its command-line flag, made from the dataclass
(``streamrl/config_flags.py``): a field added to a config can be set from the command line at once."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

import pytest

from streamrl.cli import build_parser
from streamrl.cli.up import ENGINE_FLAG_NAMES, UP_TABLES
from streamrl.cli.up_config import ENGINE_OWNED, TRAINER_OWNED, UpConfig
from streamrl.config_file import flat_names
from streamrl.config_flags import _strip_none, add_config_flags, field_docs, given
from streamrl.engine.server import EngineConfig
from streamrl.gateway.cli import FLAG_NAMES as GATEWAY_NAMES
from streamrl.gateway.config import GatewayConfig
from streamrl.judge.config import JudgeConfig
from streamrl.producers.demo_cli import DemoConfig
from streamrl.trainer.cli import FLAG_NAMES as TRAINER_NAMES
from streamrl.trainer.config import FeedConfig, TrainerConfig


def sample(tp: Any, default: Any) -> tuple[Any, list[str]]:
    """A value of type ``tp`` other than ``default``, and how it is written on the command line."""
    tp = _strip_none(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is bool:
        return (not default), [] if not default else ["no-"]
    if tp is int:
        return 7, ["7"]
    if tp is float:
        return 0.25, ["0.25"]
    if tp is str:
        return "xyz", ["xyz"]
    if origin is Literal:
        value = next(a for a in reversed(args) if a != default)
        return value, [value]
    if origin is typing.Union:  # bool | Literal[...]
        return "static", ["static"]
    if origin is tuple and args[-1] is Ellipsis:
        return ("a", "b"), ["a", "b"]
    if origin is list:
        return ["a", "b"], ["a", "b"]
    if origin is tuple:
        return (0.5, 0.75), ["0.5", "0.75"]
    if origin is dict:
        return {"k": "v"}, ['{"k": "v"}']
    raise AssertionError(f"no sample for {tp!r}")


@pytest.mark.parametrize("command, cls, names, group, skip", [
    ("trainer", TrainerConfig, TRAINER_NAMES, "", ()),
    ("gateway", GatewayConfig, GATEWAY_NAMES, "", ()),
    ("demo", DemoConfig, {}, "", ()),
    ("judge", JudgeConfig, {}, "", ()),
    ("engine", EngineConfig, {}, "", ("extra_args",)),
    ("up", UpConfig, {"upstreams": "upstream"}, "", UP_TABLES),
    ("up", EngineConfig, ENGINE_FLAG_NAMES, "engine", ENGINE_OWNED),
    ("up", DemoConfig, {}, "demo", ()),
    ("up", TrainerConfig, {}, "trainer", TRAINER_OWNED),
])
def test_every_field_has_a_flag_that_sets_it(command: str, cls: type, names: dict[str, str], group: str,
                                             skip: tuple[str, ...]) -> None:
    parser, _ = build_parser()
    for name, flag, value, words, hint in flag_cases(cls, names, group, skip):
        origin = typing.get_origin(_strip_none(hint))
        if words in ([], ["no-"]):
            argv = [f"--{words[0] if words else ''}{flag}"]
        elif origin is list or (origin is tuple and hint != tuple[float, float]):
            argv = [x for w in words for x in (f"--{flag}", w)]  # repeated: one value each
        else:
            argv = [f"--{flag}", *words]
        args = parser.parse_args([command, *argv])
        assert given(args, cls, group) == {name: value}, (name, argv)


def flag_cases(cls: type, names: dict[str, str], group: str, skip: tuple[str, ...]) -> list[tuple]:
    """(field, flag, value given, its words, type) for each flag of ``cls``; a field that is a dataclass
    (``kafka``, ``lora``) has one flag per field of its own, named by its flat name (``kafka-security-protocol``,
    ``lora-rank``, ``learning-rate``), given back as a dict of the one set."""
    hints, cases, flat = typing.get_type_hints(cls), [], flat_names(cls)
    for name, path in flat.items():
        if path[0] in skip:
            continue
        flag = names.get(name, (f"{group}-" if group else "") + name.replace("_", "-"))
        if len(path) == 2:
            table = hints[path[0]]
            sub = next(f for f in dataclasses.fields(table) if f.name == path[1])
            default = sub.default if sub.default is not dataclasses.MISSING else None
            value, words = sample(typing.get_type_hints(table)[sub.name], default)
            cases.append((path[0], flag, {sub.name: value}, words, typing.get_type_hints(table)[sub.name]))
            continue
        f = next(f for f in dataclasses.fields(cls) if f.name == name)
        default = f.default if f.default is not dataclasses.MISSING else None
        value, words = sample(hints[f.name], default)
        cases.append((f.name, flag, value, words, hints[f.name]))
    return cases


def test_flags_say_what_the_field_says() -> None:
    assert "trajectories per group" in field_docs(FeedConfig)["group_size"].lower()
    parser, _ = build_parser()
    args = parser.parse_args(["trainer"])
    assert given(args, TrainerConfig) == {}  # nothing given: the file and the defaults decide


def test_a_trainer_table_keeps_the_flags_it_had() -> None:
    """``TrainerConfig``'s concerns are nested tables, and every flag kept the flat spelling it had before they
    were (``--lora-rank``, not ``--lora-lora-rank`` or ``--optim-learning-rate``); the value lands in its table."""
    parser, _ = build_parser()
    args = parser.parse_args(["trainer", "--lora-rank", "16", "--target-modules", "q_proj", "--init-adapter", "a",
                              "--learning-rate", "1e-4", "--group-timeout", "5", "--poll-timeout-s", "1",
                              "--divergence-kl", "4", "--stop-on-divergence", "--publish-every", "2",
                              "--keep-versions", "3", "--is-mode", "ppo_clip", "--micro-batch-tokens", "512"])
    assert given(args, TrainerConfig) == {
        "lora": {"rank": 16, "target_modules": ("q_proj",), "init_adapter": "a"}, "optim": {"learning_rate": 1e-4},
        "feed": {"group_timeout_s": 5.0, "poll_timeout_s": 1.0}, "divergence": {"kl": 4.0},
        "stop_on_divergence": True, "publish": {"every": 2, "keep_versions": 3}, "loss": {"is_mode": "ppo_clip"},
        "compute": {"micro_batch_tokens": 512}}
    c = TrainerConfig.load(None, **given(args, TrainerConfig))
    assert (c.lora.rank, c.lora.alpha, c.optim.learning_rate, c.feed.group_timeout_s) == (16, 16.0, 1e-4, 5.0)
    assert (c.divergence.kl, c.publish.every, c.publish.keep_versions, c.compute.micro_batch_tokens) == (4.0, 2, 3, 512)


def test_only_picks_settings_by_field_or_flat_name() -> None:
    """``streamrl sft`` and ``streamrl batches`` take some of the trainer's settings: by flat name
    (``lora_rank``) or a whole table by its field name (``kafka``)."""
    import argparse

    p = argparse.ArgumentParser()
    add_config_flags(p, TrainerConfig, only=("model", "kafka", "lora_rank", "learning_rate"))
    flags = {o for a in p._actions for o in a.option_strings} - {"-h", "--help"}
    assert {"--model", "--lora-rank", "--learning-rate", "--kafka-security-protocol"} <= flags
    assert not flags & {"--lora-alpha", "--weight-decay", "--group-size", "--name"}


def test_help_lists_a_configs_flags_by_its_sections() -> None:
    """The trainer's many flags are grouped in ``--help`` by the section comments of ``TrainerConfig`` (model and
    Kafka, groups, GRPO, optimisation, memory and speed, divergence, publishing), every flag still there; a nested
    table's flags in the section of its field."""
    from streamrl.config_flags import field_sections

    sections = field_sections(TrainerConfig)
    assert sections["optim"] == "optimisation" and sections["loss"] == "GRPO" and sections["lora"] == "optimisation"
    assert sections["divergence"] == "divergence" and sections["kafka"].startswith("model, Kafka")
    parser, _ = build_parser(["trainer", "--help"])
    trainer = next(a for a in parser._subparsers._group_actions[0].choices.values() if a.prog.endswith("trainer"))
    titles = {g.title: {a.dest for a in g._group_actions} for g in trainer._action_groups}
    assert {"GRPO", "optimisation", "memory and speed", "divergence", "publishing", "groups"} <= set(titles)
    assert {"config___optim__learning_rate", "config___lora__rank"} <= titles["optimisation"]
    assert "config___divergence__kl" in titles["divergence"] and "config___feed__group_size" in titles["groups"]
    assert "config___kafka__sasl_mechanism" in titles[sections["kafka"]]  # a nested config: in its section
