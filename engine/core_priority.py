"""On a CPU-only machine, vLLM's engine core gives way to the processes that serve its clients.

vLLM's CPU build binds the worker's OpenMP threads to all cores but one and leaves that one to everything else:
the engine core, the API server, and on a small machine the gateway, the broker and the clients too. While a
request runs, the engine core busy-waits on the worker's answer each step (vLLM's shared-memory queue spins
with ``sched_yield`` for a second after each read), and under Linux's EEVDF scheduler a spinning process that
yields still keeps most of that core: on 2 cores the API server got under a tenth of it and, for seconds at a
time, nothing (a request sent to the engine while a long stream ran was not read until the stream had ended;
``top`` itself could not run for 5 s). Waiting is all the engine core does in those spins, so a lower priority
costs it only a little latency when the worker answers, and gives the API server, which has real work (each
step's outputs, new requests), the core whenever it needs it. GPU machines are left as they are.
"""

from __future__ import annotations

import logging
import os

from .worker_env import CORE_NICE_ENV

DEFAULT_NICE = 10
"""Niceness the engine core takes on a CPU-only machine unless ``CORE_NICE_ENV`` says otherwise (0: unchanged)."""

log = logging.getLogger("vllm.streamrl_core_priority")


def wanted_nice(environ: dict[str, str] | os._Environ[str], on_cpu: bool) -> int:
    """How much nicer the engine core should make itself: ``CORE_NICE_ENV`` if set (an integer), else
    ``DEFAULT_NICE`` on a CPU-only machine and 0 on a GPU one."""
    value = environ.get(CORE_NICE_ENV, "")
    if value.strip():
        try:
            return max(0, int(value))
        except ValueError:
            log.warning("%s=%r is not an integer: the engine core's priority is left as it is", CORE_NICE_ENV,
                        value)
            return 0
    return DEFAULT_NICE if on_cpu else 0


def give_way_on_cpu() -> int:
    """Lower this process's priority (called in the engine core) as :func:`wanted_nice` says; returns the
    increment applied."""
    from vllm.platforms import current_platform

    increment = wanted_nice(os.environ, current_platform.is_cpu())
    if increment:
        os.nice(increment)
        log.info("engine core niceness +%d: on a CPU-only machine it gives way to the API server "
                 "(engine/core_priority.py; %s=0 leaves it)", increment, CORE_NICE_ENV)
    return increment
