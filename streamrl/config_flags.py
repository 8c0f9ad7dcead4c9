"""Command-line flags made from a config dataclass: one flag per field, typed from its annotation, its help
from the field's docstring, so a part's CLI never lists its options a second time (and never falls behind).

``--flat-name`` for each setting (``names`` may keep an established spelling); every default is None,
meaning "not given", so ``streamrl.config_file.load_config`` layers defaults < file < the flags given.
A field whose type is itself a dataclass (``kafka: KafkaSettings``, ``lora: LoraConfig``) gets one flag per
field of that class, named by the field's flat name (``streamrl.config_file.flat_names``: by default
``--kafka-security-protocol``; a table that groups a part's settings by concern keeps their flags as they
were, ``--lora-rank``, ``--learning-rate``), given back as a dict of the ones given (the file's table is
merged under it).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import itertools
import json
import re
import textwrap
import types
import typing
from collections.abc import Collection, Mapping
from typing import Any, Literal

from streamrl.config_file import flat_names

_DEST = "config__"
"""Prefix of the argparse destinations, so that generated flags never clash with a CLI's own."""


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (the string literal that follows its annotation); a field
    a subclass inherits (``KafkaSettings``'s from ``KafkaSecurity``) or declares again without one keeps its
    base class's."""
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__[1:]):
        if dataclasses.is_dataclass(base):
            docs.update(_own_field_docs(base))
    return {**docs, **_own_field_docs(cls)}


def _own_field_docs(cls: type) -> dict[str, str]:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for node, after in itertools.pairwise(body):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr) \
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def field_sections(cls: type) -> dict[str, str]:
    """The section of each field of a dataclass: the comment line (``# optimisation``) above the fields that
    follow it, up to the next one; its text before any parenthesis. Fields before the first have none."""
    try:
        lines = textwrap.dedent(inspect.getsource(cls)).splitlines()
    except (OSError, TypeError):
        return {}
    sections, current = {}, ""
    for line in lines:
        if m := _SECTION.match(line):
            current = m["title"].split(" (")[0].strip()
        elif (m := _FIELD.match(line)) and current:
            sections[m["name"]] = current
    return sections


_SECTION = re.compile(r"^    # (?P<title>\S.*)$")
_FIELD = re.compile(r"^    (?P<name>[a-z_][a-z0-9_]*)\s*:")


def _strip_none(tp: Any) -> Any:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else typing.Union[tuple(args)]  # noqa: UP007
    return tp


def _bool_or_word(words: tuple[str, ...]) -> Any:
    def parse(text: str) -> bool | str:
        low = text.lower()
        if low in ("true", "yes", "on", "1"):
            return True
        if low in ("false", "no", "off", "0"):
            return False
        if low in words:
            return low
        raise argparse.ArgumentTypeError(f"expected true, false or one of {', '.join(words)}")
    return parse


def _kwargs(tp: Any) -> dict[str, Any]:
    """argparse keywords for a field of type ``tp``."""
    tp = _strip_none(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is bool:
        return {"action": argparse.BooleanOptionalAction}
    if tp in (int, float, str):
        return {"type": tp}
    if origin is Literal:
        return {"choices": list(args)}
    if origin is typing.Union and bool in args:  # e.g. compile: bool | Literal["dynamic", "static"]
        words = tuple(w for a in args if typing.get_origin(a) is Literal for w in typing.get_args(a))
        return {"type": _bool_or_word(words), "metavar": "{true,false," + ",".join(words) + "}"}
    if (origin in (tuple, list) and len(args) == 2 and args[1] is Ellipsis) or origin is list:
        return {"action": "append", "type": args[0], "metavar": args[0].__name__.upper()}
    if origin is tuple:
        return {"nargs": len(args), "type": args[0]}
    if origin is dict:
        return {"type": json.loads, "metavar": "JSON"}
    raise TypeError(f"no command-line form for {tp!r}")


def add_config_flags(p: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type, *, skip: tuple[str, ...] = (),
                     names: Mapping[str, str] | None = None, group: str = "",
                     only: Collection[str] | None = None) -> None:
    """One flag per setting of ``cls`` but ``skip`` (field names, a nested table's as a whole, or flat names);
    with ``only``, just those (the same kinds of names). ``names`` maps a flat name to its flag (without
    ``--``); ``group`` prefixes the flags (``--group-field``) and keeps their values apart (read with the same
    ``group``), for a command that configures several parts (``streamrl up``). Fields under a section comment
    of ``cls`` (:func:`field_sections`) are listed under that title in ``--help``."""
    docs, hints, sections = field_docs(cls), typing.get_type_hints(cls), field_sections(cls)
    defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    containers: dict[str, Any] = {}
    flat_of = {path: name for name, path in flat_names(cls).items()}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        table = hints[f.name] if dataclasses.is_dataclass(hints[f.name]) else None
        flat = {sub.name: flat_of[f.name, sub.name] for sub in dataclasses.fields(table)} if table else {}
        sub_skip = tuple(sub for sub, name in flat.items() if name in skip or not (
            only is None or f.name in only or name in only))
        if (only is not None and f.name not in only and not table) or (table and len(sub_skip) == len(flat)):
            continue
        section = sections.get(f.name)
        into: Any = p
        if section is not None and isinstance(p, argparse.ArgumentParser):  # --help lists flags by concern
            if section not in containers:
                containers[section] = p.add_argument_group(f"{group.strip('_').replace('__', ' ')} {section}".strip())
            into = containers[section]
        if table:
            flags = {sub: (names or {}).get(name, (f"{group}-" if group else "") + name.replace("_", "-"))
                     for sub, name in flat.items()}
            add_config_flags(into, table, skip=sub_skip, names=flags,
                             group=f"{group}__{f.name}" if group else f"_{f.name}")
            continue
        kwargs = _kwargs(hints[f.name])
        if "type" in kwargs and (kwargs.get("action") == "append" or "metavar" not in kwargs):
            kwargs["metavar"] = f.name.upper()
        text = docs.get(f.name, "")
        if f.name in defaults and defaults[f.name] not in (None, ""):
            text += f" (default {defaults[f.name]})"
        repeat = " Repeat for several." if kwargs.get("action") == "append" else ""
        flag = "--" + (names or {}).get(f.name, (f"{group}-" if group else "") + f.name.replace("_", "-"))
        into.add_argument(flag, dest=f"{_DEST}{group}__{f.name}", default=None,
                          help=(text + repeat).strip().replace("%", "%%"), **kwargs)


def given(args: argparse.Namespace, cls: type, group: str = "") -> dict[str, Any]:
    """The fields of ``cls`` whose flags were given (lists as tuples where the field is a tuple)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            nested = given(args, hints[f.name], f"{group}__{f.name}" if group else f"_{f.name}")
            if nested:
                out[f.name] = nested
            continue
        value = getattr(args, f"{_DEST}{group}__{f.name}", None)
        if value is None:
            continue
        if isinstance(value, list) and typing.get_origin(_strip_none(hints[f.name])) is tuple:
            value = tuple(value)
        out[f.name] = value
    return out
