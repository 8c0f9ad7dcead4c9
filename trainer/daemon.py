"""The trainer loop: take groups, train one step, publish a version, checkpoint, commit. Repeat.

Order of effects per published version (what makes restarts exact): adapter directory (atomic) ->
checkpoint (atomic; offsets + pending records + optimizer) -> policy record -> Kafka offset commit.
A crash before the checkpoint retrains the same groups into the same version number; a crash after it
re-announces the version on restart if the policy topic does not have it yet.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import asdict

import torch
import torch.distributed as dist
from peft import get_peft_model_state_dict, set_peft_model_state_dict

from .batch import rows, save_batch
from .config import TrainerConfig
from .feed import GroupSource, ReplayGroups, StreamGroups
from .learner import Learner
from .metrics import Metrics, batch_metrics
from .model import load_policy, pick_device
from .publish import prune, write_adapter
from .state import TrainerState, load_state, save_state

log = logging.getLogger("streamrl.trainer")


def open_source(c: TrainerConfig, state: TrainerState) -> GroupSource:
    if c.replay:
        return ReplayGroups(c.replay, state.offsets)
    from streamrl.broker.topics import Topics

    from .source import KafkaRecordSource

    records = KafkaRecordSource(c.bootstrap_servers, Topics(c.topic_prefix), c.group_id, state.offsets,
                                security=c.kafka)
    return StreamGroups(records, c, restore=state.pending, done=state.done, published=state.published)


def cpu_threads(c: TrainerConfig) -> int:
    """The trainer's torch threads on the CPU: as configured, else half the cores it may run on."""
    return c.cpu_threads or max(1, len(os.sched_getaffinity(0)) // 2)


def run_trainer(c: TrainerConfig, stop: threading.Event | None = None) -> int:
    """Run until ``stop`` is set, SIGTERM/SIGINT arrives, ``max_steps`` is reached or a replay ends."""
    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    device = pick_device(c.device) if world == 1 or c.device != "auto" else torch.device(
        f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads(c))
    torch.manual_seed(c.seed)
    model = load_policy(c, device)
    learner = Learner(model, c, device)
    state = load_state(c.state_path) or TrainerState()
    if state.lora:
        set_peft_model_state_dict(model, state.lora)
        learner.optimizer.load_state_dict(state.optimizer)
    if world > 1:  # every rank starts from rank 0's adapter weights
        for p in learner.params:
            dist.broadcast(p.data, src=0)
    log.info("rank %d/%d on %s, resuming at version %d step %d", rank, world, device, state.version, state.step)
    source = policy_log = metrics = None
    if rank == 0:
        source = open_source(c, state)
        metrics = Metrics(c.metrics_port, c.history)
        if not c.replay:
            from streamrl.broker.policy_log import PolicyLog
            from streamrl.broker.schema import PolicyRecord
            from streamrl.broker.topics import Topics

            policy_log = PolicyLog(c.bootstrap_servers, Topics(c.topic_prefix), client_id="streamrl-trainer",
                                   security=c.kafka, publisher=c.publisher)
            if state.policy and policy_log.last_version(c.name) < state.version:
                policy_log.publish(PolicyRecord(**state.policy))
    idle_since = time.monotonic()
    try:
        while True:
            done = stop.is_set() or (c.max_steps is not None and state.step >= c.max_steps)
            batches = [] if done or source is None else source.next_groups(c.groups_per_step, state.version,
                                                                             c.poll_timeout_s)
            done = done or (source is not None and source.exhausted and not batches)
            work = [done, [r for b in batches for r in rows(b)]]
            if world > 1:
                dist.broadcast_object_list(work, src=0)
            if work[0]:
                return 0
            if not work[1]:
                if metrics is not None and source is not None:
                    metrics.count(source.counts)
                continue
            timings = {"wait_s": time.monotonic() - idle_since}
            t = time.monotonic()
            stats = learner.step(work[1])
            timings["step_s"] = time.monotonic() - t
            state.step += 1
            if rank == 0 and state.step % c.publish_every == 0:
                _publish(c, model, learner, source, policy_log, metrics, state, batches, stats, timings)
            idle_since = time.monotonic()
    finally:
        if source is not None:
            source.close()
        if policy_log is not None:
            policy_log.close()


def _publish(c, model, learner, source, policy_log, metrics, state, batches, stats, timings) -> None:
    """Adapter, checkpoint, policy record, offsets: in this order (see the module docstring). The
    seconds each takes go into the step's history line, with ``wait_s`` (waiting for groups) and
    ``step_s`` (the optimizer step, packing included), so that a step's wall-clock can be read whole."""
    from streamrl.broker.schema import PolicyRecord

    groups = [b.column("group_id")[0].as_py() for b in batches]
    step = {"version": state.version + 1, "step": state.step, "groups": len(batches), **batch_metrics(batches, state.version),
            **{k: v for k, v in asdict(stats).items()}, "tokens_per_s": stats.tokens / max(stats.seconds, 1e-9)}
    t = time.monotonic()
    path, sha = write_adapter(model, c.policy_dir, state.version + 1, {"step": state.step, "groups": groups})
    timings["adapter_s"] = time.monotonic() - t
    t = time.monotonic()
    state.version += 1
    record = PolicyRecord(c.name, state.version, str(path.resolve()), c.model, state.step, sha,
                          {k: float(v) for k, v in step.items() if isinstance(v, int | float)})
    offsets = source.offsets()
    state.offsets, state.pending, state.done = offsets, source.pending_raw(), source.done_ids()
    state.published = {**source.published(), state.version: time.time()}
    state.policy = {f: getattr(record, f) for f in record.__slots__}
    state.lora = {k: v.detach().cpu() for k, v in get_peft_model_state_dict(model).items()}
    state.optimizer = learner.optimizer.state_dict()
    save_state(c.state_path, state)
    timings["checkpoint_s"] = time.monotonic() - t
    t = time.monotonic()
    if policy_log is not None:
        try:  # stamped as published now, after the checkpoint: publish -> served starts here
            policy_log.publish(record)
        except Exception as exc:  # broker away: the next version supersedes this one; a restart re-announces
            log.error("could not announce %s: %s", record.served_name, exc)
    timings["announce_s"] = time.monotonic() - t
    source.commit(offsets)
    prune(c.policy_dir, c.keep_versions)
    if c.save_batches:
        for i, b in enumerate(batches):
            save_batch(b, c.save_batches, f"{state.step:08d}-{i:03d}")
    metrics.report({**step, **timings, "group_ids": groups, "path": str(path)}, source.counts)
