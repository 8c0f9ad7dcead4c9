"""Running `streamrl up` to its end from a test: its own process group, its output in a log file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest


def run_up(args: list[str], log_path: Path, timeout: float) -> tuple[int, str]:
    """``streamrl up ARGS`` until it exits; its exit code and log. Past ``timeout`` it gets SIGINT (what
    Ctrl-C does, so it still stops what it started) and the test fails, naming the log."""
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "streamrl.cli", "up", *args], stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(120)
            pytest.fail(f"streamrl up did not finish within {timeout:.0f}s; log: {log_path}")
    return code, log_path.read_text()


def processes_mentioning(marker: str) -> list[str]:
    """Command lines of live processes that mention ``marker`` (a path unique to a test): what a run left behind."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if marker in line and "ps -eo" not in line]
