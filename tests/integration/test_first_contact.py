"""First contact: every mistake a new user can make with the installed ``streamrl`` command gets one clear
line on stderr, ``streamrl <command>: ...``, exit code 2 (1 where a service it names does not answer), no
traceback, within seconds, and leaves no process of ours running. Each case runs the real console script in a
subprocess against real files and a real port held open by this test."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

STREAMRL = str(Path(sys.executable).with_name("streamrl"))
LIMIT_S = 5.0


@dataclass(frozen=True)
class Mistake:
    name: str
    argv: Callable[[Path, int], list[str]]
    """The arguments after ``streamrl``, given the case's directory and a port held open."""
    says: str
    """A fragment the one line must hold (what is wrong)."""
    command: str = ""
    """The line's prefix after ``streamrl``: the subcommand (default: the first argument)."""
    code: int = 2
    """The exit code: 2 for a mistake in what was given, 1 for a service it was pointed at that does not answer."""


def write(path: Path, text: str | bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


def checkpoint(d: Path) -> str:
    """A directory that looks like a checkpoint (its config.json): enough to get past the model check."""
    write(d / "ckpt" / "config.json", "{}")
    return str(d / "ckpt")


MISTAKES = [
    # streamrl up: the config file
    Mistake("toml-syntax", lambda d, p: ["up", "--config", write(d / "c.toml", "[trainer]\nlearning_rate = 1e-4 x\n")],
            "c.toml:2:"),
    Mistake("misspelt-key", lambda d, p: ["up", "--config", write(d / "c.toml", "[trainer]\nlearning_rat = 1e-4\n")],
            "did you mean [trainer.optim] learning_rate"),
    Mistake("wrong-type", lambda d, p: ["up", "--config", write(d / "c.toml", '[trainer.optim]\nlearning_rate = "fast"\n')],
            "expected a number"),
    Mistake("refused-value", lambda d, p: ["up", "--config", write(d / "c.toml", "[trainer.feed]\ngroup_size = 0\n")],
            "group_size"),
    Mistake("unknown-table", lambda d, p: ["up", "--config", write(d / "c.toml", "[trainr]\nseed = 1\n")],
            "unknown table"),
    Mistake("json-syntax", lambda d, p: ["up", "--config", write(d / "c.json", '{"up": {"port": 80,}}')],
            "not valid JSON"),
    Mistake("missing-config", lambda d, p: ["up", "--config", str(d / "nope.toml")], "no such file"),
    Mistake("config-is-dir", lambda d, p: ["up", "--config", str(d)], "is a directory"),
    Mistake("config-not-text", lambda d, p: ["up", "--config", write(d / "c.toml", b"\xff\xfe\x00bad")], "cannot read"),
    Mistake("empty-key-file", lambda d, p: ["up", "--config", write(
        d / "c.toml", f'[gateway]\napi_keys = "{write(d / "keys.txt", "")}"\n')], "holds no key"),
    # streamrl up: flags
    Mistake("model-missing", lambda d, p: ["up", "--model", str(d / "no-model")], "neither a checkpoint directory"),
    Mistake("model-not-checkpoint", lambda d, p: ["up", "--model", str(d)], "not a model checkpoint"),
    Mistake("gateway-port-taken", lambda d, p: ["up", "--port", str(p)], "already in use"),
    Mistake("broker-port-taken", lambda d, p: ["up", "--broker-port", str(p)], "already in use"),
    Mistake("engine-port-taken", lambda d, p: ["up", "--engine-port", str(p)], "already in use"),
    Mistake("trainer-port-taken", lambda d, p: ["up", "--trainer-metrics-port", str(p)], "already in use"),
    Mistake("port-out-of-range", lambda d, p: ["up", "--port", "70000"], "not a port number"),
    Mistake("bad-number", lambda d, p: ["up", "--port", "eighty"], "invalid int value"),
    Mistake("bad-float", lambda d, p: ["up", "--trainer-learning-rate", "fast"], "invalid float value"),
    Mistake("unknown-option", lambda d, p: ["up", "--learning-rate", "1e-4"], "unrecognized arguments"),
    Mistake("bad-upstream-url", lambda d, p: ["up", "--upstream", "localhost:8000"], "not an http"),
    Mistake("bad-bootstrap", lambda d, p: ["up", "--bootstrap-servers", "kafka"], "not host:port"),
    Mistake("tls-file-missing", lambda d, p: ["up", "--bootstrap-servers", "127.0.0.1:9093", "--kafka-security-protocol",
                                              "SSL", "--kafka-ssl-cafile", str(d / "ca.pem")], "no such file"),
    Mistake("work-dir-under-file", lambda d, p: ["up", "--work-dir", str(Path(write(d / "f", "x")) / "run")],
            "is a file"),
    # the other commands
    Mistake("trainer-model-missing", lambda d, p: ["trainer", "--model", "/nonexistent"], "neither a checkpoint"),
    Mistake("trainer-no-model", lambda d, p: ["trainer"], "--model is required"),
    Mistake("trainer-replay-missing", lambda d, p: ["trainer", "--model", checkpoint(d), "--replay", str(d / "no")],
            "no such directory"),
    Mistake("trainer-port-taken", lambda d, p: ["trainer", "--model", checkpoint(d), "--metrics-port", str(p)],
            "already in use"),
    Mistake("trainer-config-typo", lambda d, p: ["trainer", "--config", write(d / "t.toml", "lora_rnk = 4\n")],
            "did you mean [trainer.lora] rank?"),
    Mistake("gateway-no-upstream", lambda d, p: ["gateway", "--bootstrap-servers", "127.0.0.1:9092"], "--upstream"),
    Mistake("gateway-no-broker", lambda d, p: ["gateway", "--upstream", "http://127.0.0.1:8000"],
            "--bootstrap-servers"),
    Mistake("gateway-bad-url", lambda d, p: ["gateway", "--upstream", "vllm:8000", "--bootstrap-servers",
                                             "127.0.0.1:9092"], "not an http"),
    Mistake("gateway-port-taken", lambda d, p: ["gateway", "--upstream", "http://127.0.0.1:8000", "--bootstrap-servers",
                                                "127.0.0.1:9092", "--port", str(p)], "already in use"),
    Mistake("gateway-empty-keys", lambda d, p: ["gateway", "--upstream", "http://127.0.0.1:8000", "--bootstrap-servers",
                                                "127.0.0.1:9092", "--port", "0", "--api-keys",
                                                write(d / "keys.txt", "\n")], "holds no key"),
    Mistake("gateway-public-without-keys", lambda d, p: ["gateway", "--upstream", "http://127.0.0.1:8000",
                                                         "--bootstrap-servers", "127.0.0.1:9092", "--port", "0",
                                                         "--host", "0.0.0.0"], "no API keys"),
    Mistake("gateway-tls-file-missing", lambda d, p: ["gateway", "--upstream", "http://127.0.0.1:8000", "--port", "0",
                                                      "--bootstrap-servers", "127.0.0.1:9093", "--kafka-security-protocol",
                                                      "SSL", "--kafka-ssl-cafile", str(d / "ca.pem")], "no such file"),
    Mistake("trainer-sasl-without-password", lambda d, p: ["trainer", "--model", checkpoint(d), "--kafka-security-protocol",
                                                           "SASL_PLAINTEXT", "--kafka-sasl-mechanism", "PLAIN",
                                                           "--kafka-sasl-username", "u", "--kafka-sasl-password-env",
                                                           "STREAMRL_TEST_NO_SUCH_VARIABLE"], "no SASL password"),
    Mistake("engine-model-missing", lambda d, p: ["engine", "--model", str(d / "none")], "neither a checkpoint"),
    Mistake("engine-port-taken", lambda d, p: ["engine", "--model", checkpoint(d), "--port", str(p)], "already in use"),
    Mistake("broker-port-taken", lambda d, p: ["broker", "--port", str(p)], "already in use"),
    Mistake("judge-no-model", lambda d, p: ["judge"], "--model"),
    Mistake("export-unknown-format", lambda d, p: ["export", str(d / "o.csv")], "cannot tell the format"),
    Mistake("demo-no-gateway", lambda d, p: ["demo", "--gateway", "http://127.0.0.1:1"], "no gateway answers at",
            code=1),  # port 1: nothing listens, the connection is refused
    Mistake("model-unknown-name", lambda d, p: ["model", "gpt-5", str(d / "m")], "invalid choice"),
    Mistake("unknown-command", lambda d, p: ["serve"], "invalid choice", command="-"),
]


@pytest.fixture(scope="module")
def held_port() -> Iterator[int]:
    """A port some other program is listening on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def processes_with(marker: str) -> list[str]:
    """Command lines of the processes whose environment carries ``marker`` (every process a case started
    inherits it, wherever it was re-parented)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if marker.encode() in (proc / "environ").read_bytes():
                found.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return found


@dataclass(frozen=True)
class Outcome:
    """One case's run: its arguments, the finished process, its wall time and the processes it left."""
    argv: list[str]
    done: subprocess.CompletedProcess[str]
    elapsed: float
    left: list[str]


def run_case(mistake: Mistake, directory: Path, held_port: int) -> Outcome:
    """The console script on the case's arguments, in ``directory``; the processes it left are looked for as soon
    as it has exited."""
    argv = mistake.argv(directory, held_port)
    marker = f"STREAMRL_FIRST_CONTACT={uuid.uuid4().hex}"
    env = {**os.environ, marker.split("=")[0]: marker.split("=")[1], "STREAMRL_CACHE": str(directory / "cache")}
    started = time.monotonic()
    done = subprocess.run([STREAMRL, *argv], capture_output=True, text=True, env=env, timeout=60, cwd=directory)
    return Outcome(argv, done, time.monotonic() - started, processes_with(marker))


@pytest.fixture(scope="module")
def outcomes(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
             held_port: int) -> dict[str, Outcome]:
    """The run of every case this session selected, two at a time: each case is a process of its own that mostly
    imports Python modules on one core, so on the 2-core machine two side by side took 30% less wall time than one
    after the other, and each still ends within a second or two, far inside ``LIMIT_S``."""
    selected = [item.callspec.params["mistake"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec") and "mistake" in item.callspec.params]
    directories = [tmp_path_factory.mktemp(m.name) for m in selected]
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda m, d: run_case(m, d, held_port), selected, directories))
    return {m.name: outcome for m, outcome in zip(selected, runs, strict=True)}


@pytest.mark.parametrize("mistake", MISTAKES, ids=[m.name for m in MISTAKES])
def test_mistake_is_one_line(mistake: Mistake, outcomes: dict[str, Outcome]) -> None:
    outcome = outcomes[mistake.name]
    argv, done = outcome.argv, outcome.done
    command = "streamrl" if mistake.command == "-" else f"streamrl {mistake.command or argv[0]}"
    lines = done.stderr.strip().splitlines()
    report = json.dumps({"argv": argv, "rc": done.returncode, "stderr": done.stderr[-2000:],
                         "stdout": done.stdout[-500:]}, indent=1)
    assert done.returncode == mistake.code, report
    assert len(lines) == 1 and lines[0].startswith(f"{command}: "), report
    assert mistake.says in lines[0], report
    assert "Traceback" not in done.stderr + done.stdout, report
    assert outcome.elapsed < LIMIT_S, f"{outcome.elapsed:.1f} s: {report}"
    assert not outcome.left, outcome.left
