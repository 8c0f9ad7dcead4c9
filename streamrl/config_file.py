"""One way to read typed configuration: defaults, then a TOML or JSON file, then flags.

Each part keeps its configuration in one dataclass (``GatewayConfig``, ``TrainerConfig``; ``up``'s own
tables too); this module is the only code that reads a configuration file and checks its keys and the
types of its values against a dataclass, so that every field can be set from a file, a flag that was not
given never clobbers the file, and a misspelt key or a value of the wrong type is a ``UsageError`` naming
the file, line and table, before anything starts.

A field whose type is a dataclass is a nested table (``[trainer.lora]`` in a file, a dict or an instance in
code). Each setting also has one flat name, what its flag spells and what ``load_config``'s overrides may use:
a top-level field's own name; a table's field ``prefix + name``, the prefix being the table field's ``FLAT``
metadata (default the table's name and ``_``: ``kafka_security_protocol``), unless that field's own ``FLAT``
metadata gives its whole flat name. So a part may group its settings by concern without renaming a flag.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, Literal, TypeVar

from streamrl.usage import UsageError, check_file

T = TypeVar("T")

FLAT = "flat"
"""Field metadata key for flat names (see the module's docstring): on a table field, the prefix of its fields'
flat names (``metadata={FLAT: "lora_"}``; ``""``: their own names); on a table's field, its whole flat name."""


def _is_table(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def flat_names(cls: type) -> dict[str, tuple[str, ...]]:
    """Each setting's flat name -> where it lives in ``cls``: ``("model",)``, ``("lora", "rank")``."""
    hints = typing.get_type_hints(cls)
    out: dict[str, tuple[str, ...]] = {}
    for f in fields(cls):  # type: ignore[arg-type]
        if not _is_table(hints[f.name]):
            out[f.name] = (f.name,)
            continue
        prefix = f.metadata.get(FLAT, f"{f.name}_")
        for sub in fields(hints[f.name]):
            out[sub.metadata.get(FLAT, prefix + sub.name)] = (f.name, sub.name)
    if len(out) != sum(len(fields(hints[f.name])) if _is_table(hints[f.name]) else 1
                       for f in fields(cls)):  # type: ignore[arg-type]
        raise TypeError(f"{cls.__name__}: two settings have the same flat name")
    return out


def flatten(cls: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` (a table, its nested tables as dicts) by flat name: what can be layered key by key and
    given back to ``load_config`` as overrides."""
    hints, out = typing.get_type_hints(cls), {}
    where = {path: name for name, path in flat_names(cls).items()}
    for key, value in values.items():
        if key in hints and _is_table(hints[key]) and isinstance(value, Mapping):
            out.update({where.get((key, sub), sub): v for sub, v in value.items()})
        else:
            out[key] = value
    return out


class ConfigError(UsageError):
    """A configuration file or table that cannot be used; the message names the file, line and column
    where it can."""


_TOML_WHERE = re.compile(r"\s*\(at line (\d+), column (\d+)\)$|\s*\(at end of document\)$")


def read_file(path: str | Path) -> dict[str, Any]:
    """A TOML file, or JSON for ``*.json``; a file that is missing, unreadable or does not parse is a
    ``ConfigError`` with ``file:line:column``."""
    p = check_file(path, "--config")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--config {path}: cannot read it ({exc})") from None
    if str(path).endswith(".json"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{exc.lineno}:{exc.colno}: not valid JSON: {exc.msg}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: a JSON config file holds an object of tables, not {type(data).__name__}")
        return data
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        message = str(exc)
        where = _TOML_WHERE.search(message)
        line, column = (where.group(1), where.group(2)) if where and where.group(1) else (None, None)
        what = _TOML_WHERE.sub("", message)
        loc = f"{path}:{line}:{column}" if line else str(path)
        raise ConfigError(f"{loc}: not valid TOML: {what[:1].lower()}{what[1:]} "
                          "(see https://toml.io for the syntax; strings need quotes)") from None


def key_location(path: str | Path | None, key: str, table: str = "") -> str:
    """``file:line:`` of the first ``key = ...`` in a TOML file, for messages ('' when not found); in a nested
    ``table`` (``trainer.lora``), the first after that table's header."""
    if not path or str(path).endswith(".json"):
        return f"{path}: " if path else ""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return f"{path}: "
    start = 0
    if "." in table:  # the header may name the table in full or, in a file of one part, from the part down
        header = re.compile(rf"^\s*\[\s*(?:[\w.]*\.)?{re.escape(table.rsplit('.', 1)[1])}\s*\]")
        start = next((n for n, line in enumerate(lines) if header.match(line)), 0)
    pattern = re.compile(rf"^\s*{re.escape(key)}\s*=")
    for number, line in enumerate(lines[start:], start + 1):
        if pattern.match(line):
            return f"{path}:{number}:{line.index(key) + 1}: "
    return f"{path}: "


def check_fields(cls: type, values: Mapping[str, Any], table: str, path: str | Path | None = None) -> dict[str, Any]:
    """``values`` as a dict, after checking that each key is a field of ``cls`` and each value has the
    field's type (ints taken for floats; lists for tuples; a nested table's keys and values too)."""
    if not isinstance(values, Mapping):
        raise ConfigError(f"{path or 'config'}: [{table}] must be a table of settings, not {type(values).__name__}")
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    for key in sorted(set(values) - set(names)):
        raise ConfigError(f"{key_location(path, key, table)}unknown option {key!r} in [{table}] "
                          f"({_hint(cls, key, table)})")
    hints = typing.get_type_hints(cls)
    out = dict(values)
    for key, value in values.items():
        if _is_table(hints[key]) and isinstance(value, Mapping):
            out[key] = check_fields(hints[key], value, f"{table}.{key}", path)
            continue
        try:
            out[key] = _typed(value, hints[key])
        except TypeError as exc:
            raise ConfigError(f"{key_location(path, key, table)}[{table}] {key}: {exc}") from None
    return out


def _hint(cls: type, key: str, table: str) -> str:
    """What an unknown ``key`` of ``[table]`` may have meant: a setting that lives in a nested table under that
    flat name or one spelt like it (``lora_rank`` -> ``[trainer.lora] rank``), a field spelt like it, or else
    every setting there is."""
    flat = {name: path for name, path in flat_names(cls).items() if len(path) == 2}
    names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    close = [key] if key in flat else difflib.get_close_matches(key, [*names, *flat], n=1)
    if not close:
        return f"the [{table}] settings: {', '.join(names)}"
    where = flat.get(close[0])
    return f"did you mean [{table}.{where[0]}] {where[1]}?" if where else f"did you mean {close[0]}?"


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _typed(value: Any, tp: Any) -> Any:
    """``value`` checked against the annotation ``tp`` (ints become floats where a float is wanted);
    ``TypeError`` saying what was expected. Types this does not know are let through as they are."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if isinstance(tp, types.UnionType) or origin is typing.Union:
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _typed(value, option)
            except TypeError as exc:
                errors.append(str(exc).removeprefix("expected "))
        raise TypeError(f"expected {' or '.join(errors)}")
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise TypeError(f"expected true or false, got {_describe(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise TypeError(f"expected a whole number, got {_describe(value)}")
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise TypeError(f"expected a number, got {_describe(value)}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise TypeError(f"expected a string, got {_describe(value)}")
    if origin is Literal:
        if value in args:
            return value
        raise TypeError(f"expected one of {', '.join(map(repr, args))}, got {_describe(value)}")
    if origin in (tuple, list):
        if not isinstance(value, list | tuple):
            raise TypeError(f"expected a list, got {_describe(value)}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise TypeError(f"expected a list of {len(args)} values, got {_describe(value)}")
            return tuple(_typed(v, a) for v, a in zip(value, args, strict=True))
        item = args[0] if args else Any
        checked = [_typed(v, item) for v in value]
        return tuple(checked) if origin is tuple else checked
    if origin is dict or tp is dict:
        if isinstance(value, Mapping):
            return value
        raise TypeError(f"expected a table, got {_describe(value)}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp | Mapping):
            return value
        raise TypeError(f"expected a table, got {_describe(value)}")
    return value


def nest(cls: type, values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` given by flat name (``lora_rank``) or field name (``lora={...}``) as ``cls``'s table in a file
    holds them (``{"lora": {"rank": ...}}``); None values (not given) left out, unknown keys kept for
    ``check_fields`` to name."""
    hints, where, out = typing.get_type_hints(cls), flat_names(cls), {}
    for k, v in values.items():
        if v is None:
            continue
        if k not in hints and k in where:  # a flat name: one field of a nested table
            k, v = where[k][0], {where[k][1]: v}
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            v = {**out[k], **v}
        out[k] = v
    return out


def load_config(cls: type[T], path: str | Path | None, table: str, overrides: Mapping[str, Any]) -> T:
    """``cls`` from its defaults, then the file (its ``[table]`` table when it has one, else the whole
    file), then the overrides whose value is not None: field names (a nested table as a dict merged over the
    file's, or an instance) or flat names (``lora_rank``, routed into their table). Unknown keys, values of the
    wrong type, values the class refuses and fields without a default that neither gives are ``ConfigError``s
    naming them."""
    values: dict[str, Any] = {}
    if path:
        data = read_file(path)
        values.update(check_fields(cls, data.get(table, data), table, path))
    hints = typing.get_type_hints(cls)
    for k, v in nest(cls, overrides).items():
        if isinstance(v, Mapping) and k in hints and _is_table(hints[k]):  # a nested table: over the file's
            v = {**_as_table(values.get(k)), **v}
        values[k] = v
    values = check_fields(cls, values, table, path)
    missing = [f.name for f in fields(cls)  # type: ignore[arg-type]
               if f.name not in values and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise ConfigError(f"[{table}]: {', '.join(missing)} must be given")
    try:
        values = {k: hints[k](**v) if _is_table(hints[k]) and isinstance(v, Mapping) else v for k, v in values.items()}
        return cls(**values)
    except UsageError:
        raise
    except (ValueError, TypeError, FileNotFoundError) as exc:  # a value the class itself refuses
        raise ConfigError(f"{path}: [{table}]: {exc}" if path else f"[{table}]: {exc}") from None


def _as_table(value: Any) -> dict[str, Any]:
    """A nested table's value so far (none, a dict, or an instance) as a dict that overrides can go over."""
    if value is None:
        return {}
    if dataclasses.is_dataclass(value):
        return {f.name: getattr(value, f.name) for f in fields(value)}
    return dict(value)
