"""One way to read typed configuration: defaults, then a TOML or JSON file, then flags.

Each part keeps its configuration in one dataclass (``GatewayConfig``, ``TrainerConfig``; ``up``'s own
tables too); this module is the only code that reads a configuration file and checks its keys and the
types of its values against a dataclass, so that every field can be set from a file, a flag that was not
given never clobbers the file, and a misspelt key or a value of the wrong type is a ``UsageError`` naming
the file, line and table, before anything starts.
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


def key_location(path: str | Path | None, key: str) -> str:
    """``file:line:`` of the first ``key = ...`` in a TOML file, for messages ('' when not found)."""
    if not path or str(path).endswith(".json"):
        return f"{path}: " if path else ""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return f"{path}: "
    pattern = re.compile(rf"^\s*{re.escape(key)}\s*=")
    for number, line in enumerate(lines, 1):
        if pattern.match(line):
            return f"{path}:{number}:{line.index(key) + 1}: "
    return f"{path}: "


def check_fields(cls: type, values: Mapping[str, Any], table: str, path: str | Path | None = None) -> dict[str, Any]:
    """``values`` as a dict, after checking that each key is a field of ``cls`` and each value has the
    field's type (ints taken for floats; lists for tuples)."""
    if not isinstance(values, Mapping):
        raise ConfigError(f"{path or 'config'}: [{table}] must be a table of settings, not {type(values).__name__}")
    names = [f.name for f in fields(cls)]
    for key in sorted(set(values) - set(names)):
        close = difflib.get_close_matches(key, names, n=1)
        hint = f" (did you mean {close[0]}?)" if close else f" (the [{table}] settings: {', '.join(names)})"
        raise ConfigError(f"{key_location(path, key)}unknown option {key!r} in [{table}]{hint}")
    hints = typing.get_type_hints(cls)
    out = dict(values)
    for key, value in values.items():
        try:
            out[key] = _typed(value, hints[key])
        except TypeError as exc:
            raise ConfigError(f"{key_location(path, key)}[{table}] {key}: {exc}") from None
    return out


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


def load_config(cls: type[T], path: str | Path | None, table: str, overrides: Mapping[str, Any]) -> T:
    """``cls`` from its defaults, then the file (its ``[table]`` table when it has one, else the whole
    file), then the overrides whose value is not None. Unknown keys, values of the wrong type, values the
    class refuses and fields without a default that neither gives are ``ConfigError``s naming them."""
    values: dict[str, Any] = {}
    if path:
        data = read_file(path)
        values.update(check_fields(cls, data.get(table, data), table, path))
    for k, v in overrides.items():
        if isinstance(v, Mapping) and isinstance(values.get(k), Mapping):  # a nested table: flags over the file's
            values[k] = {**values[k], **v}
        elif v is not None:
            values[k] = v
    values = check_fields(cls, values, table, path)
    missing = [f.name for f in fields(cls)  # type: ignore[arg-type]
               if f.name not in values and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise ConfigError(f"[{table}]: {', '.join(missing)} must be given")
    try:
        return cls(**values)
    except UsageError:
        raise
    except (ValueError, TypeError, FileNotFoundError) as exc:  # a value the class itself refuses
        raise ConfigError(f"{path}: [{table}]: {exc}" if path else f"[{table}]: {exc}") from None
