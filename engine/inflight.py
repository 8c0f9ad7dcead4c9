"""In-flight updates: a running request moves to its policy's newest adapter version between two decode steps.

The gateway serves each adapter version under its own name (``<policy>@v<N>``) and, in the ``in-flight``
update mode, marks the requests it routed by policy name (not the ones a client pinned to ``<policy>@v<N>``)
with :data:`FOLLOW` in ``SamplingParams.extra_args`` (through the capture header; ``engine/capture.py``). The
gateway routes a version only once it is loaded on the engine, so the first marked request that arrives on
``<policy>@v<N>`` says that ``N`` is loaded and routed; from the next step on, every marked request of that
policy still on an older version runs on ``N`` (:class:`MovePlanner`, in the engine core's scheduler). Why the
scheduler and not a reload in place: versions keep their own names, so pinned requests, evaluations of one
version and the record of which version produced which token all stay exact; and the scheduler is the one
place that knows, per request, which step (so which sampled token) is the first on the new version.

The cache policy is the request's (:data:`FOLLOW`'s value, from the gateway's ``in_flight_cache``). ``keep``: the
KV cache of the tokens before the switch is kept (PipelineRL's choice): they were computed under the older
adapter, which the trainer's recompute does not see. ``recompute`` (AReaL's): at the move the running request
is preempted as vLLM preempts for room (its blocks freed, back to the front of the waiting queue) with its
block hashes made again under the new adapter, so its prompt and tokens so far are prefilled again under the
new adapter (cached blocks of that adapter, e.g. a group's shared prompt, are reused) and every later token is
sampled exactly as a request pinned to the new version would sample it (:func:`restart`).

Two halves, pinned with token capture to ``vllm_hooks.TESTED_VERSIONS``:

* engine core: the capture scheduler sets the moved requests' ``lora_request`` (so its LoRA budget and block
  hashes follow) and hands the step's moves to the worker as ``SchedulerOutput.streamrl_moves``; each move
  also goes to the API server with the step's outputs (:data:`MOVES_KEY`), where the capture turns it into the
  choice's version spans;
* worker: vLLM has no extension point for a running request's adapter, so ``vllm_hooks.wrap_model_runners``
  (installed by streamrl's vLLM plugin) has the model runners call :func:`apply_moves` on the runner's request
  states and persistent batch before the step's inputs are built.
"""

from __future__ import annotations

import inspect
import logging
import re
from dataclasses import dataclass
from typing import Any

FOLLOW = "streamrl_follow"
"""``SamplingParams.extra_args`` key of a request that may move to its policy's newest version; its value is the
cache policy at a move, :data:`KEEP` or :data:`RECOMPUTE`."""

KEEP, RECOMPUTE = "keep", "recompute"
"""Cache policies at a move: keep the KV cache computed under the older adapter, or compute it again."""

MOVES_KEY = "streamrl_moves"
"""``kv_transfer_params`` key, on the first output of a step's message to one API server, carrying
``[[request id, first token index on the new version, version, its served name], ...]``; also the ``SchedulerOutput``
attribute carrying ``{request id: LoRARequest}`` to the worker."""

_SERVED = re.compile(r"(?P<policy>.+)@v(?P<version>[0-9]+)")

log = logging.getLogger("vllm.streamrl_inflight")


def served_version(lora_name: str | None) -> tuple[str, int] | None:
    """(policy, version) of an adapter served as ``<policy>@v<N>``; None for anything else."""
    if not lora_name:
        return None
    m = _SERVED.fullmatch(lora_name)
    return (m["policy"], int(m["version"])) if m else None


@dataclass(slots=True)
class Move:
    request_id: str
    client_index: int
    first_token: int
    """Index (in the request's sampled tokens) of the first token the new version produces."""
    version: int
    lora_request: Any
    recompute: bool = False
    """Its KV cache is computed again under the new adapter (:func:`restart`), not kept."""


class MovePlanner:
    """Which marked requests move to which version, decided in the engine core's thread.

    ``newest`` holds, per policy, the newest version a marked request arrived on (with its ``LoRARequest``);
    only a change of it makes a step look through the requests, so a step without news costs one check."""

    def __init__(self) -> None:
        self.newest: dict[str, tuple[int, Any]] = {}
        self._news: set[str] = set()
        """Policies whose newest version changed since the last step."""
        self.moved = 0
        """Requests moved so far (in flight when they moved)."""

    def arrived(self, request: Any) -> Move | None:
        """Note a new request; a marked one behind its policy's newest version moves before its first step."""
        if not _follows(request):
            return None
        served = served_version(request.lora_request.lora_name)
        if served is None:
            return None
        policy, version = served
        newest = self.newest.get(policy)
        if newest is None or version > newest[0]:
            self.newest[policy] = (version, request.lora_request)
            if newest is not None:
                self._news.add(policy)
                log.info("in-flight updates: %s@v%d routed; requests on older versions of %s move to it",
                         policy, version, policy)
            return None
        if version < newest[0]:
            return self._move(request, policy, *newest)
        return None

    def plan(self, requests: dict[str, Any]) -> list[Move]:
        """The moves of this step: every unfinished marked request of a policy with news, still on an older version."""
        if not self._news:
            return []
        news, self._news = self._news, set()
        moves = []
        for request in requests.values():
            if request.is_finished() or not _follows(request):
                continue
            served = served_version(request.lora_request.lora_name)
            if served is None or served[0] not in news:
                continue
            version, lora_request = self.newest[served[0]]
            if served[1] < version:
                moves.append(self._move(request, served[0], version, lora_request))
        if moves:
            log.info("in-flight updates: %d running requests moved (%s)", len(moves),
                     ", ".join(f"to v{m.version} from token {m.first_token}" for m in moves[:4]))
        return moves

    def _move(self, request: Any, policy: str, version: int, lora_request: Any) -> Move:
        first = len(request.output_token_ids) + getattr(request, "num_output_placeholders", 0)
        request.lora_request = lora_request
        self.moved += 1
        recompute = (request.sampling_params.extra_args or {}).get(FOLLOW) == RECOMPUTE
        return Move(request.request_id, request.client_index, first, version, lora_request, recompute)


def restart(scheduler: Any, move: Move) -> None:
    """The ``recompute`` cache policy, in the engine core before the step is scheduled: the moved request's
    block hashes are made again under its new adapter (the old ones name the older adapter's blocks, which a
    re-prefill would otherwise find cached), and a running one is preempted as vLLM's own
    ``reset_prefix_cache(reset_running_requests=True)`` preempts (blocks freed, output still in flight dropped
    and sampled again), so that the scheduler prefills it again, in this step if there is room. Its first token
    on the new version is then the first one after those it has."""
    import time

    request = scheduler.requests.get(move.request_id)
    if request is None:
        return
    if request.status.name == "RUNNING":
        scheduler.running.remove(request)
        preempt = scheduler._preempt_request
        if "drop_stale_output" in inspect.signature(preempt).parameters:  # vLLM 0.32
            preempt(request, time.monotonic(), drop_stale_output=True)
        else:  # vLLM 0.26: as its reset_prefix_cache does after the same call
            preempt(request, time.monotonic())
            request.async_tokens_to_discard = request.num_output_placeholders
            request.num_output_placeholders = 0
        scheduler.prev_step_scheduled_req_ids.discard(request.request_id)
        move.first_token = len(request.output_token_ids)
    rehash(request)


def rehash(request: Any) -> None:
    """A request's block hashes under the adapter it now has (vLLM's hasher puts the adapter in each hash)."""
    request.block_hashes.clear()
    request.update_block_hashes()


def _follows(request: Any) -> bool:
    params = request.sampling_params
    return (getattr(request, "lora_request", None) is not None and params is not None
            and bool((params.extra_args or {}).get(FOLLOW)))


def apply_moves(runner: Any, moves: dict[str, Any]) -> int:
    """Put moved requests on their new adapter in a model runner, before the step's LoRA inputs are built;
    returns how many the runner holds (one it has not seen yet arrives with the new adapter already).

    vLLM's first model runner (the CPU build's) keeps a request's adapter in its request state (read when the
    request is added back to the persistent batch) and in the batch's LoRA mapping; the second (``gpu/``, the
    GPU build's default for dense models) in its ``LoraState`` by request id and by batch row."""
    lora_state = getattr(runner, "lora_state", None)
    applied = 0
    for request_id, lora_request in moves.items():
        if lora_state is not None:  # model runner V2
            row = runner.req_states.req_id_to_index.get(request_id)
            if row is None:
                continue
            lora_state.lora_requests[request_id] = lora_request
            lora_state.lora_ids[row] = lora_request.lora_int_id
        else:
            state = runner.requests.get(request_id)
            if state is None:
                continue
            state.lora_request = lora_request
            _remap(runner.input_batch, request_id, lora_request)
        applied += 1
    return applied


def _remap(batch: Any, request_id: str, lora_request: Any) -> None:
    """The persistent batch's LoRA mapping of one request (model runner V1), as its ``add_request`` sets it."""
    row = batch.req_id_to_index.get(request_id)
    if row is None:
        return
    old = int(batch.request_lora_mapping[row])
    holders = batch.lora_id_to_request_ids.get(old)
    if holders is not None:
        holders.discard(request_id)
        if not holders:
            del batch.lora_id_to_request_ids[old]
            batch.lora_id_to_lora_request.pop(old, None)
    new = lora_request.lora_int_id
    batch.request_lora_mapping[row] = new
    batch.lora_id_to_request_ids.setdefault(new, set()).add(request_id)
    batch.lora_id_to_lora_request[new] = lora_request
