"""Config files: a mistake is a ``ConfigError`` naming the file, line and column, the table and the key;
values are checked against the dataclass's types (ints taken for floats, lists for tuples)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from streamrl.config_file import ConfigError, check_fields, load_config, read_file
from streamrl.usage import UsageError


@dataclass
class Settings:
    rate: float = 0.1
    count: int = 1
    name: str = "a"
    on: bool = False
    mode: Literal["x", "y"] = "x"
    pair: tuple[float, float] = (0.9, 0.99)
    names: tuple[str, ...] = ()
    limit: int | None = None

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError("count must be >= 1")


@pytest.mark.parametrize("text, error", [
    ("[s]\nrate = 1e-4 x\n", r"c.toml:2:13: not valid TOML"),
    ("[s]\nrat = 0.1\n", r"c.toml:2:1: unknown option 'rat' in \[s\] \(did you mean rate\?\)"),
    ("[s]\nzzz = 0.1\n", r"unknown option 'zzz' in \[s\] \(the \[s\] settings: rate, count"),
    ("[s]\nrate = 'fast'\n", r"c.toml:2:1: \[s\] rate: expected a number, got 'fast' \(str\)"),
    ("[s]\ncount = 1.5\n", r"\[s\] count: expected a whole number"),
    ("[s]\ncount = true\n", r"\[s\] count: expected a whole number"),
    ("[s]\non = 'yes'\n", r"\[s\] on: expected true or false"),
    ("[s]\nmode = 'z'\n", r"\[s\] mode: expected one of 'x', 'y'"),
    ("[s]\npair = [1]\n", r"\[s\] pair: expected a list of 2 values"),
    ("[s]\nnames = 'a'\n", r"\[s\] names: expected a list"),
    ("[s]\nlimit = 'none'\n", r"\[s\] limit: expected a whole number, got 'none'"),
    ("[s]\ncount = 0\n", r"c.toml: \[s\]: count must be >= 1"),
])
def test_a_bad_file_names_where_and_what(tmp_path: Path, text: str, error: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=error):
        load_config(Settings, path, "s", {})


def test_values_are_converted_to_the_declared_types(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[s]\nrate = 1\npair = [1, 2]\nnames = ['a', 'b']\nlimit = 3\n")
    s = load_config(Settings, path, "s", {"count": 2, "name": None})
    assert (s.rate, s.pair, s.names, s.limit, s.count, s.name) == (1.0, (1.0, 2.0), ("a", "b"), 3, 2, "a")
    assert isinstance(s.rate, float)


def test_json_files_and_unreadable_ones(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text('{"s": {"rate": 0.2,}}')
    with pytest.raises(ConfigError, match=r"c.json:1:20: not valid JSON"):
        read_file(path)
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="holds an object of tables"):
        read_file(path)
    with pytest.raises(UsageError, match="no such file"):
        read_file(tmp_path / "missing.toml")
    with pytest.raises(UsageError, match="is a directory"):
        read_file(tmp_path)
    (tmp_path / "bin.toml").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="cannot read it"):
        read_file(tmp_path / "bin.toml")


def test_a_table_that_is_not_a_table() -> None:
    with pytest.raises(ConfigError, match=r"\[s\] must be a table"):
        check_fields(Settings, [1, 2], "s")  # type: ignore[arg-type]
