"""Token capture's engine-core half: a step's sampled-token logprobs leave the engine core as one column.

``streamrl engine`` names :func:`capture_scheduler` in vLLM's own ``--scheduler-cls`` option; the API
server half is ``engine/capture.py``. Why it exists: the engine core's one thread is what bounds
generation at hundreds of requests in flight (py-spy: busy in every sample), and for a request with
``logprobs`` vLLM's scheduler gives every step's output of every request its own ``LogprobsLists`` (three
numpy arrays), which its msgpack encoder and decoder handle in Python, per request and step, in both
processes (``bench/engine_output_bench.py``; figures in docs/benchmarks.md). When no request in flight
asks for logprobs but the ones the API server marked (:data:`MARK` in ``extra_args``: the gateway's
capture, not a client's own ``logprobs``), this scheduler hands vLLM's loop the step without its logprobs
and sends them once per step and API server instead: the step's float32 column, the row of each request
and the rows' starts, under :data:`STEP_KEY` in the ``kv_transfer_params`` of the first output of the
step's message (:func:`attach_step`). The API server half cuts each request's logprobs out of it: the
per-request work moves out of the engine core's thread. A step where a client's own logprobs ride along is
left to vLLM (every request gets its arrays, the API server half reads the marked ones from those).

Pinned, with the API server half, to ``vllm_hooks.TESTED_VERSIONS``: the subclass relies on the shapes of
``EngineCoreOutputs``, ``ModelRunnerOutput`` and ``LogprobsLists`` there; on any other vLLM the factory
returns vLLM's own scheduler unchanged. The base class follows vLLM's own choice (``AsyncScheduler`` when
async scheduling is on), so nothing else about scheduling changes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .core_priority import give_way_on_cpu
from .inflight import MOVES_KEY, Move, MovePlanner, rehash, restart
from .vllm_hooks import version_ok

MARK = "streamrl_capture"
"""``SamplingParams.extra_args`` key the API server half sets on the requests whose logprobs are its own."""

STEP_KEY = "streamrl_step"
"""``kv_transfer_params`` key, on the first output of a step's message to one API server, carrying
``[outputs in the message, {request id: row}, float32 column bytes, rows' starts or None]``."""


def attach_step(outputs_by_client: dict[int, Any], batch: Any, req_id_to_index: dict[str, int]) -> None:
    """Give each API server's message of this step the step's sampled-token logprobs, once.

    ``batch`` is the step's ``LogprobsLists``: row ``req_id_to_index[id]`` (or, with speculative decoding,
    rows from ``cu_num_generated_tokens[that]``) holds a request's tokens, column 0 the sampled token's
    logprob; the API server half takes as many rows as the output has tokens, as vLLM's own
    ``slice_request`` would. Everything here is per step, nothing per request: msgpack encodes the dict,
    the bytes and the list natively."""
    column = np.ascontiguousarray(batch.logprobs[:, 0], dtype=np.float32).tobytes()
    for outputs in outputs_by_client.values():
        outs = outputs.outputs
        if not outs:
            continue
        first = outs[0]
        params = first.kv_transfer_params
        if params is None:
            params = first.kv_transfer_params = {}
        params[STEP_KEY] = [len(outs), req_id_to_index, column, batch.cu_num_generated_tokens]


def attach_moves(outputs_by_client: dict[int, Any], moves: list[Move]) -> list[Move]:
    """Tell each API server of its requests' moves, on the first output of its message of this step; the moves
    of an API server with no output in this step wait for the next (returned)."""
    waiting = []
    by_client: dict[int, list[list[Any]]] = {}
    for m in moves:
        outputs = outputs_by_client.get(m.client_index)
        if outputs is None or not outputs.outputs:
            waiting.append(m)
        else:
            by_client.setdefault(m.client_index, []).append([m.request_id, m.first_token, m.version,
                                                             m.lora_request.lora_name])
    for client, told in by_client.items():
        first = outputs_by_client[client].outputs[0]
        if first.kv_transfer_params is None:
            first.kv_transfer_params = {}
        first.kv_transfer_params[MOVES_KEY] = told
    return waiting


class _CaptureMixin:
    """vLLM's scheduler, sending the marked requests' logprobs as one column per step (:func:`attach_step`).

    Keeps the ids of the requests whose client asked for logprobs itself: while any is in flight, vLLM's
    own per-request logprobs are needed and the step is left as it is."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._own_logprobs: set[str] = set()
        """Ids of the requests in flight whose client asked for logprobs itself."""
        self.mover = MovePlanner()
        """In-flight updates (``engine/inflight.py``): which marked requests move to a newer version."""
        self._moves: list[Move] = []
        """Moves not yet told to their API server (with the outputs of the step they took effect in)."""
        super().__init__(*args, **kwargs)

    def add_request(self, request: Any) -> None:
        params = request.sampling_params
        if params is not None and params.logprobs is not None and not (params.extra_args or {}).get(MARK):
            self._own_logprobs.add(request.request_id)
        move = self.mover.arrived(request)
        if move is not None:
            if move.recompute:  # nothing computed yet: its prompt's blocks are to be the new adapter's
                rehash(request)
            self._moves.append(move)
        super().add_request(request)  # type: ignore[misc]

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        moves = self.mover.plan(self.requests)  # type: ignore[attr-defined]
        for move in moves:
            if move.recompute:
                restart(self, move)
        output = super().schedule(*args, **kwargs)  # type: ignore[misc]
        if moves:  # the worker applies them before this step's inputs are built
            setattr(output, MOVES_KEY, {m.request_id: m.lora_request for m in moves})
            self._moves += moves
        return output

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> dict[int, Any]:
        batch = model_runner_output.logprobs
        own = self._own_logprobs
        if own:  # forget the ones vLLM has let go of (finished, aborted)
            own.intersection_update(self.requests)  # type: ignore[attr-defined]
        if not batch or own:
            outputs = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        else:
            model_runner_output.logprobs = None
            try:
                outputs = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
            finally:
                model_runner_output.logprobs = batch
            attach_step(outputs, batch, model_runner_output.req_id_to_index)
        if self._moves:
            self._moves = attach_moves(outputs, self._moves)
        return outputs


_CLASSES: dict[type, type] = {}


def capture_scheduler(*args: Any, vllm_config: Any, **kwargs: Any) -> Any:
    """What ``--scheduler-cls`` names: vLLM's own scheduler class for this config, with the capture mixin.

    vLLM calls the named object with the scheduler's arguments, so a factory can pick the base class that
    vLLM itself would have picked (it chooses ``AsyncScheduler`` only when no scheduler class is named).
    """
    import vllm
    from vllm.v1.core.sched.scheduler import Scheduler

    give_way_on_cpu()  # the one streamrl hook that runs in the engine core's process
    base: type = Scheduler
    if vllm_config.scheduler_config.async_scheduling:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler

        base = AsyncScheduler
    if not version_ok(vllm.__version__):
        return base(*args, vllm_config=vllm_config, **kwargs)
    cls = _CLASSES.get(base)
    if cls is None:
        cls = _CLASSES[base] = type(f"Capture{base.__name__}", (_CaptureMixin, base), {})
    return cls(*args, vllm_config=vllm_config, **kwargs)
