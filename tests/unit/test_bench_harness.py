"""bench/harness.py: what every result file records about its run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import harness  # noqa: E402  (bench/ is a folder of scripts, not a package)


def test_a_stamp_names_the_machine_the_code_the_command_and_the_time() -> None:
    s = harness.stamp()
    assert set(s) == {"machine", "commit", "command", "date"}
    assert f"{__import__('os').cpu_count()} cores" in s["machine"] and "Python " in s["machine"]
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    assert s["commit"].split("+")[0] == head
    assert s["date"].endswith("Z") and s["date"][:2] == "20"


def test_a_copy_without_git_reads_its_commit_file(tmp_path: Path) -> None:
    assert harness.commit(tmp_path) == "unknown"
    (tmp_path / "COMMIT").write_text("abc1234\n")
    assert harness.commit(tmp_path) == "abc1234"


def test_a_copy_inside_another_checkout_reads_its_commit_file(tmp_path: Path) -> None:
    """The GPU staging copy (``.clean``, ignored by git) sits inside the checkout: its COMMIT file, not the outer
    repository's HEAD, says what it holds."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    copy = tmp_path / ".clean"
    copy.mkdir()
    (copy / "COMMIT").write_text("c62d0dd\n")
    assert harness.commit(copy) == "c62d0dd"
