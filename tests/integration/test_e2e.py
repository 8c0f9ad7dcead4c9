"""End to end on the CPU: `streamrl up --demo` (embedded broker, vLLM, gateway, trainer, demo producer)
on the demo model, until the policy has been retrained and hot-swapped many times. The reward must
rise, with no request failing and nothing left running afterwards."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from support.up_run import run_up

from streamrl.producers.demo_model import build_demo_model

TARGET = 0.8
"""The run stops once the last 6 groups (48 trajectories) of trained versions average this."""
MARGIN = 0.25
"""The last 3 versions' mean reward must exceed the first 3 versions' by this much (they start near 0.4);
fewer a side when fewer than 6 versions served (the gateway serves only the newest of versions published
in quick succession, so a run that learns fast may serve 3: the windows must not overlap)."""


def _leftovers(marker: str) -> list[str]:
    """Command lines of live processes that mention ``marker`` (a path unique to this test)."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if marker in line and "ps -eo" not in line]


def _mean(versions: dict[str, dict], keys: list[int]) -> float:
    n = sum(versions[str(k)]["n"] for k in keys)
    return sum(versions[str(k)]["mean"] * versions[str(k)]["n"] for k in keys) / n


def test_reward_rises_through_streamrl_up(tmp_path: Path) -> None:
    model = build_demo_model(tmp_path / "demo-model")
    work = tmp_path / "run"
    summary = tmp_path / "summary.json"
    code, text = run_up(["--model", str(model), "--port", "0", "--work-dir", str(work), "--demo",
                         "--demo-until-reward", str(TARGET), "--demo-stop-groups", "6", "--demo-max-seconds", "480",
                         "--demo-summary", str(summary)], tmp_path / "up.log", timeout=840)
    assert code == 0, text[-5000:]

    result = json.loads(summary.read_text())
    versions = {int(v): s for v, s in result["versions"].items()}
    served = sorted(versions)
    print("reward per version:", {v: round(versions[v]["mean"], 3) for v in served})
    assert result["failed"] == 0, "every request and reward post of the demo must succeed"
    # the gateway serves only the newest of versions published in quick succession, and a fast run reaches the
    # target on few of them (one CI run: v1, v2 and v3 published within 0.4 s, v2 served no group, target met
    # on v3): at least 3 trained versions hot-swapped in, at least 2 of them serving the demo's traffic
    swapped = {int(v) for v in re.findall(r"now served by \S+@v(\d+)", text)}
    assert len(swapped) >= 3, f"at least 3 trained versions must be hot-swapped in; got {sorted(swapped)}"
    assert len([v for v in served if v >= 1]) >= 2, f"at least 2 trained versions must serve; got {served}"
    k = min(3, len(served) // 2)  # the first and last versions, never overlapping: a fast run may serve few
    first, last = served[:k], served[-k:]
    before, after = _mean(result["versions"], first), _mean(result["versions"], last)
    print(f"mean reward of versions {first}: {before:.3f}; of versions {last}: {after:.3f}; margin {MARGIN}")
    assert after >= before + MARGIN, f"reward did not rise: {before:.3f} -> {after:.3f}"

    assert f"reward target {TARGET} reached" in text
    assert "stopped (exit code 0)" in text
    # the parts that hold what was acknowledged stop by themselves on SIGTERM (vLLM, holding nothing, may be killed
    # at its deadline on a loaded machine: streamrl.cli.up.STOP_DEADLINES_S)
    assert not re.search(r"(gateway|trainer|judge) still running .* killed", text), "a part was killed on stop"
    assert "leaked semaphore" not in text, "the parts must exit cleanly (their exit handlers run)"
    assert "DIVERGING" not in text, "the demo's normal run must not be judged diverging (trainer/divergence.py)"
    assert _leftovers(str(tmp_path)) == [], "no process of the run may outlive `streamrl up`"
