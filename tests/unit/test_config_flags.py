"""Every field of every part's configuration has its command-line flag, made from the dataclass
(``streamrl/config_flags.py``): a field added to a config can be set from the command line at once."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

import pytest

from streamrl.cli import build_parser
from streamrl.cli.up import ENGINE_FLAG_NAMES, ENGINE_OWNED, UP_TABLES, UpConfig
from streamrl.config_flags import _strip_none, field_docs, given
from streamrl.engine.server import EngineConfig
from streamrl.gateway.cli import FLAG_NAMES as GATEWAY_NAMES
from streamrl.gateway.config import GatewayConfig
from streamrl.judge.config import JudgeConfig
from streamrl.producers.demo_cli import DemoConfig
from streamrl.trainer.cli import FLAG_NAMES as TRAINER_NAMES
from streamrl.trainer.config import TrainerConfig


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
    (``kafka``) has one flag per field of its own, given back as a dict of the one set."""
    hints, cases = typing.get_type_hints(cls), []
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = names.get(f.name, (f"{group}-" if group else "") + f.name.replace("_", "-"))
        if dataclasses.is_dataclass(hints[f.name]):
            sub_hints = typing.get_type_hints(hints[f.name])
            for sub in dataclasses.fields(hints[f.name]):
                value, words = sample(sub_hints[sub.name], sub.default)
                cases.append((f.name, f"{flag}-{sub.name.replace('_', '-')}", {sub.name: value}, words,
                              sub_hints[sub.name]))
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        value, words = sample(hints[f.name], default)
        cases.append((f.name, flag, value, words, hints[f.name]))
    return cases


def test_flags_say_what_the_field_says() -> None:
    assert "trajectories per group" in field_docs(TrainerConfig)["group_size"].lower()
    parser, _ = build_parser()
    args = parser.parse_args(["trainer"])
    assert given(args, TrainerConfig) == {}  # nothing given: the file and the defaults decide


def test_help_lists_a_configs_flags_by_its_sections() -> None:
    """The trainer's many flags are grouped in ``--help`` by the section comments of ``TrainerConfig`` (model and
    Kafka, groups, GRPO, optimisation, divergence, publishing), every flag still there."""
    from streamrl.config_flags import field_sections

    sections = field_sections(TrainerConfig)
    assert sections["learning_rate"] == "optimisation" and sections["clip_eps"] == "GRPO"
    assert sections["divergence_kl"] == "divergence" and sections["kafka"].startswith("model, Kafka")
    parser, _ = build_parser(["trainer", "--help"])
    trainer = next(a for a in parser._subparsers._group_actions[0].choices.values() if a.prog.endswith("trainer"))
    titles = {g.title: {a.dest for a in g._group_actions} for g in trainer._action_groups}
    assert {"GRPO", "optimisation", "divergence", "publishing", "groups"} <= set(titles)
    assert "config____learning_rate" in titles["optimisation"]
    assert "config___kafka__sasl_mechanism" in titles[sections["kafka"]]  # a nested config: in its section
