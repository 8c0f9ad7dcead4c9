"""The folders form layers with no cycle: ``streamrl/`` (shared helpers) imports no part, the parts import
``streamrl/`` and each other without a cycle, and only ``cli/`` (the command and ``up``) imports them all.
Read from the source with ``ast`` (imports inside functions included), so a lazy import counts too."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("engine", "gateway", "broker", "trainer", "producers", "judge")
FOLDERS = ("streamrl", "cli", *PARTS)
FRONT_DOOR = ROOT / "streamrl" / "__init__.py"
"""``streamrl.batches``, the library's API, reaches up into the trainer lazily: the one allowed way up."""


def imported_folders(path: Path) -> set[str]:
    """The folders (by their package under ``streamrl``) that a module imports."""
    folder = path.relative_to(ROOT).parts[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: inside its own folder
                continue
            names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "streamrl" and len(parts) > 1 and parts[1] in FOLDERS[1:]:
                found.add(parts[1])
            elif parts[0] == "streamrl" and len(parts) > 1:
                found.add("streamrl")
    found.discard(folder)
    return found


def edges() -> dict[str, dict[str, list[str]]]:
    """folder -> imported folder -> the modules that import it."""
    graph: dict[str, dict[str, list[str]]] = {f: {} for f in FOLDERS}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == FRONT_DOOR:
                continue
            for target in imported_folders(path):
                graph[folder].setdefault(target, []).append(str(path.relative_to(ROOT)))
    return graph


def test_the_shared_helpers_import_no_part() -> None:
    assert edges()["streamrl"] == {}


def test_only_the_command_imports_the_command() -> None:
    graph = edges()
    assert not [f for f in FOLDERS if "cli" in graph[f]], {f: graph[f]["cli"] for f in FOLDERS if "cli" in graph[f]}


def test_the_parts_form_no_cycle() -> None:
    graph = edges()
    order = list(graphlib.TopologicalSorter({f: set(graph[f]) for f in FOLDERS}).static_order())
    assert order[0] == "streamrl" and order[-1] == "cli"


def test_the_reading_sees_imports() -> None:
    """The rule could pass by reading nothing: the known edges are there."""
    graph = edges()
    assert {"broker", "engine", "streamrl"} <= set(graph["gateway"]) and "trainer" in graph["cli"]
