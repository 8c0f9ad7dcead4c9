"""One way to read typed configuration: defaults, then a TOML or JSON file, then flags.

Each part keeps its configuration in one dataclass (``GatewayConfig``, ``TrainerConfig``; ``up``'s own
tables too); this module is the only code that reads a configuration file and checks its keys against
a dataclass, so that every field can be set from a file, a flag that was not given never clobbers the
file, and a misspelt key is an error naming it and its table.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def read_file(path: str | Path) -> dict[str, Any]:
    """A TOML file, or JSON for ``*.json``."""
    text = Path(path).read_text()
    return json.loads(text) if str(path).endswith(".json") else tomllib.loads(text)


def check_fields(cls: type, values: Mapping[str, Any], table: str) -> dict[str, Any]:
    """``values`` as a dict, after checking that each key is a field of ``cls``."""
    unknown = sorted(set(values) - {f.name for f in fields(cls)})
    if unknown:
        raise ValueError(f"unknown option(s) in [{table}]: {', '.join(unknown)}")
    return dict(values)


def load_config(cls: type[T], path: str | Path | None, table: str, overrides: Mapping[str, Any]) -> T:
    """``cls`` from its defaults, then the file (its ``[table]`` table when it has one, else the whole
    file), then the overrides whose value is not None. Unknown keys, and fields without a default that
    neither gives, are errors naming them."""
    values: dict[str, Any] = {}
    if path:
        data = read_file(path)
        values.update(data.get(table, data))
    for k, v in overrides.items():
        if isinstance(v, Mapping) and isinstance(values.get(k), Mapping):  # a nested table: flags over the file's
            values[k] = {**values[k], **v}
        elif v is not None:
            values[k] = v
    check_fields(cls, values, table)
    missing = [f.name for f in fields(cls)  # type: ignore[arg-type]
               if f.name not in values and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise ValueError(f"[{table}]: {', '.join(missing)} must be given")
    return cls(**values)
