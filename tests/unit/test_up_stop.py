"""``streamrl up``'s stop order (``Stack.stop`` in cli/up.py), with real child processes: the engines get SIGTERM
only once the gateway, their only client, has exited (stopped together, vLLM's engine core went down under the
gateway's calls in flight), and an engine that does not exit soon after its SIGTERM is killed then, not at the
stop's last deadline (a SIGTERM landing in an adapter load left vLLM's API server waiting until killed at 13 s)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from streamrl.cli import up
from streamrl.cli.up import Stack
from streamrl.cli.up_config import load_config

CHILD = """
import pathlib, signal, sys, time
out, delay = pathlib.Path(sys.argv[1]), float(sys.argv[2])
def stop(*_):
    out.with_suffix('.term').write_text(repr(time.monotonic()))
    time.sleep(delay)  # a part that takes a moment to stop
    out.with_suffix('.exit').write_text(repr(time.monotonic()))
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
out.with_suffix('.ready').touch()
while True:
    signal.pause()
"""


def child(marker: Path, delay: float) -> subprocess.Popen:
    """A process that notes when SIGTERM arrives and when it exits, ``delay`` seconds later; started in a group
    of its own (``up`` signals its parts' groups) and returned once its handler is in place."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(marker), str(delay)], start_new_session=True)
    deadline = time.monotonic() + 60
    while not marker.with_suffix(".ready").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the child did not start"
        time.sleep(0.01)
    return proc


def stamp(marker: Path, what: str) -> float:
    return float(marker.with_suffix(f".{what}").read_text())


def test_engines_are_stopped_after_the_gateway_has_exited(tmp_path: Path) -> None:
    stack = Stack(load_config(None, work_dir=str(tmp_path / "run")))
    gateway, trainer, engine = tmp_path / "gateway", tmp_path / "trainer", tmp_path / "engine"
    stack.children = {"gateway": child(gateway, 1.0), "trainer": child(trainer, 0.0)}
    stack.engines = [SimpleNamespace(url="http://127.0.0.1:9", proc=child(engine, 0.0))]  # type: ignore[list-item]
    stack.stop()

    assert all(p.returncode == 0 for p in [*stack.children.values(), stack.engines[0].proc])
    assert stamp(trainer, "term") < stamp(gateway, "exit"), "the trainer is told at once, beside the gateway"
    assert stamp(engine, "term") >= stamp(gateway, "exit"), "an engine was stopped under its gateway"


def test_an_engine_hung_on_its_stop_is_killed_soon_after_its_sigterm(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(up, "ENGINE_STOP_S", 0.5)
    stack = Stack(load_config(None, work_dir=str(tmp_path / "run")))
    gateway, engine = tmp_path / "gateway", tmp_path / "engine"
    stack.children = {"gateway": child(gateway, 0.0)}
    stack.engines = [SimpleNamespace(url="http://127.0.0.1:9", proc=child(engine, 60.0))]  # type: ignore[list-item]
    started = time.monotonic()
    stack.stop()

    took = time.monotonic() - started
    assert stack.engines[0].proc.returncode == -signal.SIGKILL and stamp(engine, "term") > started
    assert took < up.STOP_DEADLINES_S["engine"] / 2, "waited for the stop's last deadline"
    assert took >= 0.5, "killed before its own time was up"
