"""Per-step metrics: one progress line, Prometheus gauges/counters on /metrics, a JSONL history."""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.compute as pc

from .batch import Batch
from .tracking import Tracker, numbers

log = logging.getLogger("streamrl.trainer")

FEED_COUNTERS = {
    "reads_paused": ("streamrl_trainer_reads_paused", "times reading from Kafka paused (ready queue full)"),
    "reads_paused_s": ("streamrl_trainer_reads_paused_seconds", "seconds reading from Kafka was paused"),
    "tokens_generated": ("streamrl_trainer_generated_tokens", "completion tokens of every group that became ready"),
    "tokens_trained": ("streamrl_trainer_trained_tokens", "completion tokens of the groups trained on"),
}
"""Counts that are not record outcomes get their own Prometheus counters (``<name>_total``)."""


def batch_metrics(batch: Batch, version: int) -> dict[str, Any]:
    """Reward and staleness statistics of a step's batch (one reward per trajectory).

    Staleness is per sampled token (the version trained minus the version that sampled it, ``token_versions``:
    a request moved to newer versions mid-way has tokens of several): ``staleness_mean`` and ``staleness_max``
    over the tokens trained, ``staleness_tokens`` counts them by staleness (``{"0": n0, "1": n1, ...}``), so
    that staleness per sampled token (mean, quantiles, max) over a run is exact. It is the one non-number here:
    consumers that want numbers filter by type (policy record, /metrics).

    Multi-turn merging: ``trajectories_multi_call`` counts the trajectories of more than one call, and
    ``trajectories_split`` those of them whose calls became more than one sequence (a later prompt did not
    start with the earlier prompt and sampled tokens: a template that renders an earlier turn again otherwise,
    docs/loop.md, "What merges"); the others merged into one."""
    mask, versions = batch.loss_mask, batch.token_versions
    sampled = mask.values[mask.offsets[0]:mask.offsets[-1]] == 1
    lags = version - versions.values[versions.offsets[0]:versions.offsets[-1]][sampled].astype(np.int64)
    values, counts = np.unique(lags, return_counts=True)
    tokens: Counter[int] = Counter(dict(zip(values.tolist(), counts.tolist(), strict=True)))
    if not lags.size:  # nothing trained (every token left out): the sequences' oldest versions say how stale
        lags = version - batch.policy_version.astype(np.int64)
    rewards: dict[str, float] = {}
    calls: Counter[str] = Counter()  # a trajectory's calls, over its sequences
    sequences: Counter[str] = Counter()
    per_row = pc.list_value_length(batch.record.column("request_ids")).to_numpy(zero_copy_only=False).tolist()
    for tid, reward, n in zip(batch.trajectory_ids, batch.reward.tolist(), per_row, strict=True):
        rewards.setdefault(tid, reward)
        calls[tid] += n
        sequences[tid] += 1
    r = list(rewards.values())
    multi = [tid for tid, n in calls.items() if n > 1]
    return {
        "reward_mean": float(np.mean(r)), "reward_std": float(np.std(r)),
        "trajectories": len(r), "staleness_mean": float(np.mean(lags)), "staleness_max": float(lags.max()),
        "staleness_tokens": {str(lag): n for lag, n in sorted(tokens.items())},
        "trajectories_multi_call": len(multi), "trajectories_split": sum(sequences[tid] > 1 for tid in multi),
    }


PER_STEP = {"groups_trained": "trained", "groups_dropped_stale": "stale", "groups_no_signal": "no signal",
            "groups_dropped_overload": "overload"}
"""Group outcomes reported per step (``<name>_step`` in the history and on /metrics) and in the log line."""


class Metrics:
    """Everything a step reports goes through ``report``."""

    def __init__(self, port: int | None = None, history: str | None = None,
                 trackers: list[Tracker] | None = None) -> None:
        self.history = Path(history) if history else None
        self.trackers = trackers or []
        """``report_to``'s trackers (``tracking.py``), each given every step's numbers."""
        self.port = port
        self._last: Counter[str] = Counter()
        """``PER_STEP`` counts at the previous report."""
        self._gauges: dict[str, Any] = {}
        self._counter = None
        self.registry = None
        if port is not None:
            from prometheus_client import CollectorRegistry, start_http_server
            from prometheus_client import Counter as PromCounter

            self.registry = CollectorRegistry()
            self._counter = PromCounter("streamrl_trainer_records", "assembler and record outcomes",
                                        ["outcome"], registry=self.registry)
            self._counted: Counter[str] = Counter()
            self._feed_counters = {k: PromCounter(name, doc, registry=self.registry)
                                   for k, (name, doc) in FEED_COUNTERS.items()}
            self._diverging = PromCounter("streamrl_trainer_diverging_steps",
                                          "published steps trained while diverging (trainer/divergence.py)",
                                          registry=self.registry)
            server = start_http_server(port, registry=self.registry)
            self.port = server[0].server_port if isinstance(server, tuple) else port

    def _gauge(self, name: str):
        from prometheus_client import Gauge

        g = self._gauges.get(name)
        if g is None:
            g = self._gauges[name] = Gauge(f"streamrl_trainer_{name}", name.replace("_", " "), registry=self.registry)
        return g

    def count(self, counts: Counter[str]) -> None:
        """Bring the /metrics counters up to ``counts``. Called at each step and while the trainer waits for
        groups, so what the feed classifies between steps (a saturated task's groups without signal, the
        groups left when the run stops) is on /metrics too, not only at the next step."""
        if self.registry is None:
            return
        for k, v in counts.items():
            if v > self._counted[k]:
                counter = self._feed_counters[k] if k in FEED_COUNTERS else self._counter.labels(k)
                counter.inc(v - self._counted[k])
                self._counted[k] = v

    def report(self, step: dict[str, Any], counts: Counter[str]) -> None:
        step = {**step, **{f"{k}_step": counts[k] - self._last[k] for k in PER_STEP},
                "generated_tokens_trained_share": counts["tokens_trained"] / max(counts["tokens_generated"], 1)}
        self._last = Counter({k: counts[k] for k in PER_STEP})
        skipped = counts["groups_no_signal"]
        dropped = sum(counts[k] for k in ("groups_dropped_stale", "groups_dropped_unusable", "incomplete_dropped",
                                         "groups_dropped_overload"))
        bad = sum(v for k, v in counts.items() if k.startswith("bad_"))
        log.info(
            "v%d step %d | reward %.3f±%.3f | groups %d (total skipped %d dropped %d, bad records %d) | "
            "tok %d (%.0f/s) | stale %.1f/%d | loss %+.4f | ratio %.3f trunc %.3f | kl %.4f | gnorm %.3f",
            step["version"], step["step"], step["reward_mean"], step["reward_std"], step["groups"], skipped, dropped,
            bad, step["tokens"], step["tokens_per_s"], step["staleness_mean"], step["staleness_max"], step["loss"],
            step["ratio_mean"], step["truncated_frac"], step["kl_behaviour"], step["grad_norm"],
        )
        log.info("v%d groups this step: %s | %.0f%% of generated tokens trained so far", step["version"],
                 ", ".join(f"{label} {step[k + '_step']}" for k, label in PER_STEP.items()),
                 100 * step["generated_tokens_trained_share"])
        if "wait_s" in step:
            log.info("v%d seconds: waited %.2f, step %.2f, adapter %.2f, checkpoint %.2f, announce %.2f", step["version"],
                     step["wait_s"], step["step_s"], step["adapter_s"], step["checkpoint_s"], step["announce_s"])
        if self.registry is not None:
            for k, v in step.items():
                if isinstance(v, int | float):
                    self._gauge(k).set(v)
            if step.get("diverging"):
                self._diverging.inc()
        self.count(counts)
        for tracker in self.trackers:
            tracker.log(numbers(step), step["step"])
        if self.history is not None:
            self.history.parent.mkdir(parents=True, exist_ok=True)
            with open(self.history, "a") as f:
                f.write(json.dumps({"time": time.time(), **step, "counts": dict(counts)}) + "\n")

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
