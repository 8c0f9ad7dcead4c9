"""The trainer loop: take a step's batch, train it, publish a version, checkpoint, acknowledge. Repeat.

The daemon is one user of the batch stream (``stream.py``), as any learner is: ``next()`` hands it a
step's Arrow batch, ``ack(batch, version)`` follows its checkpoint. Order of effects per published
version (what makes restarts exact): adapter directory (atomic) -> checkpoint (atomic; weights, optimizer,
version) -> policy record -> ``ack`` (the stream's position, then the Kafka offset commit). A crash
before the checkpoint retrains the same groups into the same version number; a crash after it resumes
the stream after the batch (the checkpoint's version is newer than the acknowledgement) and re-announces
the version if the policy topic does not have it yet.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import torch
import torch.distributed as dist
from peft import get_peft_model_state_dict, set_peft_model_state_dict

from streamrl.child import stop_on_signals

from .batch import Batch, group_slices
from .batch_io import save_parquet
from .config import TrainerConfig
from .divergence import EXIT_DIVERGED, DivergenceDetector, Verdict
from .feed_state import FeedState
from .learner import Learner
from .metrics import Metrics, batch_metrics
from .model import load_policy, pick_device
from .publish import prune, write_adapter
from .state import TrainerState, load_state, save_state
from .stream import BatchStream
from .tracking import open_trackers

if TYPE_CHECKING:
    from streamrl.broker.schema import PolicyRecord

log = logging.getLogger("streamrl.trainer")


def legacy_position(state: TrainerState) -> FeedState | None:
    """The stream position a checkpoint written before the stream kept its own (``feed_state.py``) holds."""
    if not (state.pending or state.done or state.published):  # written empty since: only offsets, for the record
        return None
    return FeedState(dict(state.offsets), list(state.pending), list(state.done), dict(state.published))


def cpu_threads(c: TrainerConfig) -> int:
    """The trainer's torch threads on the CPU: as configured, else half the cores it may run on."""
    return c.cpu_threads or max(1, len(os.sched_getaffinity(0)) // 2)


@dataclass
class StepWork:
    """What rank 0 tells every rank before each step (other ranks read nothing from Kafka)."""

    stop: bool
    batch: pa.RecordBatch | None
    """The step's batch; None when no group was ready in time (no step, ask again)."""


class Trainer:
    """The daemon: every rank holds the model and takes part in each step; rank 0 also reads the groups,
    publishes versions, checkpoints and reports."""

    def __init__(self, c: TrainerConfig, stop: threading.Event) -> None:
        self.c, self.stop = c, stop
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        device = pick_device(c.device) if self.world == 1 or c.device != "auto" else torch.device(
            f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
        if device.type == "cpu":
            torch.set_num_threads(cpu_threads(c))
        torch.manual_seed(c.seed)
        self.model = load_policy(c, device)
        self.learner = Learner(self.model, c, device)
        self.state = load_state(c.state_path) or TrainerState()
        if self.state.lora:
            set_peft_model_state_dict(self.model, self.state.lora)
            self.learner.optimizer.load_state_dict(self.state.optimizer)
        if self.world > 1:  # every rank starts from rank 0's adapter weights
            for p in self.learner.params:
                dist.broadcast(p.data, src=0)
        log.info("rank %d/%d on %s, resuming at version %d step %d", self.rank, self.world, device,
                 self.state.version, self.state.step)
        self.stream: BatchStream | None = None
        self.metrics: Metrics | None = None
        self.divergence = DivergenceDetector(c.divergence.for_mode(c.loss.is_mode), c.optim.learning_rate, c.feed.max_lag, c.feed.backlog)
        self.trained: list[tuple[int, Batch]] = []
        """(step, batch) of each step trained since the last published version."""
        self.halted = False
        """Set by rank 0 when ``stop_on_divergence`` stops the run: every rank is told to stop at the next step."""
        self.policy_log = None
        if self.rank == 0:
            self.stream = BatchStream(c, version=self.state.version, initial=legacy_position(self.state), stop=stop)
            trackers = open_trackers(c.report_to, c.tracking_path, c.run_name or c.name,
                                     {**asdict(c), "kafka": c.kafka.redacted()}) if c.report_to else []
            self.metrics = Metrics(c.metrics_port, c.history, trackers)
            if not c.replay:
                from streamrl.broker.policy_log import PolicyLog
                from streamrl.broker.schema import PolicyRecord
                from streamrl.broker.topics import Topics

                self.policy_log = PolicyLog(c.kafka.bootstrap_servers, Topics(c.kafka.topic_prefix), client_id="streamrl-trainer",
                                            security=c.kafka, publisher=c.publisher)
                if self.state.policy and self.policy_log.last_version(c.name) < self.state.version:
                    self.policy_log.publish(PolicyRecord(**self.state.policy))
                elif not self.state.policy:
                    self._start_versions()

    def _start_versions(self) -> None:
        """No checkpoint: our versions follow the topic's newest of our name (an SFT ``--publish``, say), whose
        samples are not from the future. Starting from an ``init_adapter`` the fleet does not serve yet, that
        adapter is published first as the next version: otherwise the first steps' groups would be sampled
        from one policy (the served one) and trained as if from another (ours), their staleness uncounted."""
        from streamrl.broker.schema import WEIGHTS_FILE, sha256_file

        assert self.policy_log is not None and self.stream is not None
        c, state = self.c, self.state
        newest = self.policy_log.newest(c.name)
        state.version = newest.version if newest is not None else 0
        self.stream.version = max(self.stream.version, state.version)
        if c.lora.init_adapter and (newest is None
                                    or newest.sha256 != sha256_file(Path(c.lora.init_adapter) / WEIGHTS_FILE)):
            record = self._release({"step": state.step, "init_adapter": str(Path(c.lora.init_adapter).resolve())},
                                   {"init_adapter": 1.0})
            self.stream.version = max(self.stream.version, state.version)
            log.info("published the initial adapter %s as %s v%d: the fleet serves what training starts from",
                     c.lora.init_adapter, c.name, record.version)

    def run(self) -> int:
        """Step until told to stop, ``max_steps`` is reached or a replay ends."""
        c, state = self.c, self.state
        idle_since = time.monotonic()
        try:
            while True:
                work = self._next_work()
                if work.stop:
                    return EXIT_DIVERGED if self.halted else 0
                if work.batch is None:
                    if self.metrics is not None and self.stream is not None:
                        self.metrics.count(self.stream.counts)
                    continue
                timings = {"wait_s": time.monotonic() - idle_since}
                t = time.monotonic()
                batch = Batch.of(work.batch)
                stats = self.learner.step(batch)
                timings["step_s"] = time.monotonic() - t
                state.step += 1
                if self.rank == 0:
                    numbers = {**batch_metrics(batch, state.version), **asdict(stats)}
                    verdict = self._judge(numbers)
                    if verdict.diverging and c.stop_on_divergence:
                        self._halt()
                    else:
                        self.trained.append((state.step, batch))
                        if state.step % c.publish.every == 0:
                            self._publish(work.batch, numbers, verdict, timings)
                idle_since = time.monotonic()
        finally:
            self.close()

    def _next_work(self) -> StepWork:
        """Rank 0 takes the step's batch from the stream and sends every rank the same ``StepWork``."""
        c, stream = self.c, self.stream
        stop = self.stop.is_set() or self.halted or (c.max_steps is not None and self.state.step >= c.max_steps)
        batch = None if stop or stream is None else stream.next()
        stop = stop or (stream is not None and stream.exhausted and batch is None)
        message = [StepWork(stop, batch)]
        if self.world > 1:
            dist.broadcast_object_list(message, src=0)
        return message[0]

    def _judge(self, numbers: dict[str, Any]) -> Verdict:
        """Judge the step just taken (every step, published or not: the window holds steps); a diverging one
        is a WARNING naming the measured values, the thresholds and the likely cause."""
        verdict = self.divergence.judge(numbers)
        if verdict.diverging:
            log.warning("v%d step %d DIVERGING: %s", self.state.version + 1, self.state.step, verdict.message)
        return verdict

    def _halt(self) -> None:
        """``stop_on_divergence``: stop before anything of this step is written (adapter, checkpoint, policy
        record, offsets), so a restart retrains its groups from the last good version."""
        self.halted = True
        log.error("stopping before publishing v%d (stop_on_divergence): the trainer is diverging and nothing "
                  "of this step was saved; to resume, lower learning_rate (now %g) and start the trainer again: "
                  "it continues from v%d and retrains the groups since", self.state.version + 1,
                  self.c.optim.learning_rate, self.state.version)

    def _publish(self, batch: pa.RecordBatch, numbers: dict[str, Any], verdict: Verdict,
                 timings: dict[str, float]) -> None:
        """Adapter, checkpoint, policy record, acknowledgement: in this order (see the module docstring). The
        seconds each takes go into the step's history line, with ``wait_s`` (waiting for groups) and
        ``step_s`` (the optimizer step, packing included), so that a step's wall-clock can be read whole.
        ``numbers``: the step's batch metrics and ``StepStats``; ``verdict`` goes in as ``diverging`` (1.0 or
        0.0, also in the policy record's metrics: the dashboard's warning). The record takes the numbers only
        (``staleness_tokens``, a histogram, and text stay in the history line)."""
        c, state, stream, metrics = self.c, self.state, self.stream, self.metrics
        assert stream is not None and metrics is not None
        trained, self.trained = self.trained, []
        groups = [g for _, b in trained for g in b.group_ids]
        step = {"version": state.version + 1, "step": state.step, "groups": len(groups), **numbers,
                "tokens_per_s": numbers["tokens"] / max(numbers["seconds"], 1e-9),
                "diverging": float(verdict.diverging)}
        if verdict.diverging:
            step["divergence"] = verdict.message
        lag = stream.lag()
        if lag is not None:
            step["kafka_lag"] = lag
        record = self._release({"step": state.step, "groups": groups},
                               {k: float(v) for k, v in step.items() if isinstance(v, int | float)}, timings)
        stream.ack(batch, record.version)
        prune(c.policy_dir, c.publish.keep_versions)
        if c.save_batches:  # one Parquet file per group, as trained (zero-copy slices of the step's batch)
            for step_no, b in trained:
                for i, part in enumerate(group_slices(b.record)):
                    save_parquet(part, c.save_batches, f"{step_no:08d}-{i:03d}")
        metrics.report({**step, **timings, "group_ids": groups, "path": record.path}, stream.counts)

    def _release(self, meta: dict[str, Any], metrics: dict[str, float],
                 timings: dict[str, float] | None = None) -> PolicyRecord:
        """The model as it is now, as the next version: adapter directory, checkpoint, policy record, in this
        order (the module docstring); the seconds of each into ``timings``."""
        from streamrl.broker.schema import PolicyRecord

        c, state, stream = self.c, self.state, self.stream
        assert stream is not None
        timings = {} if timings is None else timings
        t = time.monotonic()
        path, sha = write_adapter(self.model, c.policy_dir, state.version + 1, meta)
        timings["adapter_s"] = time.monotonic() - t
        t = time.monotonic()
        state.version += 1
        record = PolicyRecord(c.name, state.version, str(path.resolve()), c.model, state.step, sha, metrics)
        # the stream keeps its position (feed_state.py); the offsets read through are recorded here too
        state.offsets, state.pending, state.done, state.published = stream.offsets, [], [], {}
        state.policy = {f: getattr(record, f) for f in record.__slots__}
        state.lora = {k: v.detach().cpu() for k, v in get_peft_model_state_dict(self.model).items()}
        state.optimizer = self.learner.optimizer.state_dict()
        save_state(c.state_path, state)
        timings["checkpoint_s"] = time.monotonic() - t
        t = time.monotonic()
        if self.policy_log is not None:
            try:  # stamped as published now, after the checkpoint: publish -> served starts here
                self.policy_log.publish(record)
            except Exception as exc:  # broker away: the next version supersedes this one; a restart re-announces
                log.error("could not announce %s: %s", record.served_name, exc)
        timings["announce_s"] = time.monotonic() - t
        return record

    def close(self) -> None:
        if self.metrics is not None:
            self.metrics.close()
        if self.stream is not None:
            self.stream.close()
        if self.policy_log is not None:
            self.policy_log.close()


def run_trainer(c: TrainerConfig, stop: threading.Event | None = None) -> int:
    """Run until ``stop`` is set, ``max_steps`` is reached or a replay ends. Without a ``stop`` event,
    SIGTERM/SIGINT set one installed here (in the main thread); ``streamrl trainer`` installs its
    handlers before anything slow starts, so that a stop during start-up is a clean stop too."""
    if stop is None:
        stop = threading.Event()
        if threading.current_thread() is threading.main_thread():
            stop_on_signals(stop)
    return Trainer(c, stop).run()
