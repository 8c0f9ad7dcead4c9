"""One way to read a part's typed configuration: defaults, then a TOML or JSON file, then flags.

Each part keeps its configuration in one dataclass (``GatewayConfig``, ``TrainerConfig``); this module
is the only code that turns a file and command-line overrides into one, so that every field can be set
from a file, and a flag that was not given never clobbers the file.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def load_config(cls: type[T], path: str | Path | None, table: str, overrides: Mapping[str, Any]) -> T:
    """``cls`` from its defaults, then the file (TOML, or JSON for ``*.json``; its ``[table]`` table when
    it has one, else the whole file), then the overrides whose value is not None. Unknown keys, and
    fields without a default that neither gives, are errors naming them."""
    values: dict[str, Any] = {}
    if path:
        text = Path(path).read_text()
        data = json.loads(text) if str(path).endswith(".json") else tomllib.loads(text)
        values.update(data.get(table, data))
    values.update({k: v for k, v in overrides.items() if v is not None})
    known = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"unknown {table} option(s): {', '.join(unknown)}")
    missing = [name for name, f in known.items() if name not in values
               and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise ValueError(f"{table}: {', '.join(missing)} must be given")
    return cls(**values)
