"""What the live dashboard (``/dashboard``) shows: small bounded aggregates kept by the gateway itself.

The gateway already sees every piece of the run the dashboard draws: which version of which policy served
each call, every posted reward, every published version (with the trainer's per-step metrics in the policy
record's ``metrics``: reward and staleness of the trained groups, tokens/s, Kafka lag), when each version
was routed, the producer's record counts and the upstreams' health. This module keeps of them, per policy
the gateway serves (a ``PolicyBoard`` each; its policy's follower tells it what is published and routed):

- per version (at most ``max_versions``, oldest dropped): the rewards of the calls that version served
  (count, sum, sum of squares: mean and spread), the calls it served, its publication and routing times
  and the trainer's metrics of the step that made it;
- the base model's held-out score, against which every evaluation is marked ``below_base``; the page's
  warnings (``warnings``) are computed from these when it asks;

and for the whole gateway a ring of ``max_points`` samples taken every ``interval_s`` by one background task:
counters (tokens, requests, rewards, records by outcome), healthy upstreams, and per policy its routed
version, calls by status, rewards naming it and swaps (the labelled counters of ``/metrics``).

Cost on the request path: a served call that was logged adds one dict entry (its trajectory id -> policy and
version, at most ``max_tracked``, oldest evicted) so that its reward, posted later, is counted for the version
that served it, not for whichever is routed when the reward arrives; a posted reward is one dict pop and a few
adds. Everything else happens in the sampler and when the dashboard asks (``snapshot``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from streamrl.broker.schema import PolicyRecord, RewardRecord
from streamrl.gateway.recording.log_producer import ProducerStats

from .metrics import GatewayMetrics
from .policy import PolicyRouter
from .upstreams import UpstreamPool

RECENT_VERSIONS = 5
"""The divergence warning looks at this many of the newest published versions: one diverging among them is
recent enough to act on (the trainer's log names the likely cause)."""

COUNTED = frozenset(("streamrl_gateway_requests", "streamrl_gateway_rewards", "streamrl_gateway_tokens",
                     "streamrl_gateway_policy_requests", "streamrl_gateway_policy_swaps"))
"""The metric families the sampler reads (``prometheus_client`` names counters without ``_total``)."""


@dataclass(slots=True)
class VersionStats:
    """One policy version as the gateway saw it."""

    version: int
    calls: int = 0
    """Logged calls it served (``purpose`` train)."""
    rewards: int = 0
    reward_sum: float = 0.0
    reward_sq: float = 0.0
    first_reward: float = 0.0
    """Wall-clock time of its first reward (0: none yet)."""
    published: float = 0.0
    """When the trainer published it (the policy record's ``created``; 0 for version 0 or not seen)."""
    routed: float = 0.0
    """When the policy name was routed to it here (0: not (yet) routed)."""
    trainer: dict[str, float] = field(default_factory=dict)
    """The policy record's ``metrics``: the trainer's step that made this version."""
    eval: dict[str, Any] | None = None
    """Its held-out evaluation, as an evaluator reported it (``POST /dashboard/eval``), with ``below_base``:
    its score is below the base model's (version 0's evaluation; false until that is known)."""
    changed: int = 0
    """The ``Dashboard.seq`` that will include its last change: a viewer at an older ``seq`` gets it again."""

    def view(self) -> dict[str, Any]:
        n = self.rewards
        mean = self.reward_sum / n if n else None
        std = math.sqrt(max(0.0, self.reward_sq / n - mean * mean)) if n else None
        return {"version": self.version, "calls": self.calls, "rewards": n, "reward_mean": mean, "reward_std": std,
                "first_reward": self.first_reward or None, "published": self.published or None,
                "routed": self.routed or None,
                "publish_to_route_s": self.routed - self.published if self.routed and self.published else None,
                "trainer": self.trainer, "eval": self.eval}


class PolicyBoard:
    """One policy's part of the dashboard: its versions as this gateway saw them, its base model's held-out
    score and its warnings. Its policy's follower (``hotswap.py``) calls ``published`` and ``routed``."""

    def __init__(self, dashboard: Dashboard, router: PolicyRouter) -> None:
        self.dashboard, self.router = dashboard, router
        self.versions: dict[int, VersionStats] = {}
        self.base_score: float | None = None
        """Version 0's held-out score (kept apart: version 0 is the first to leave ``versions``)."""
        self.calls = 0
        """Logged calls (``purpose`` train) its versions served."""
        self.rewards = 0
        """Rewards counted for its versions (their call was one it served)."""

    @property
    def name(self) -> str:
        return self.router.name

    def _version(self, version: int) -> VersionStats:
        stats = self.versions.get(version)
        if stats is None:
            stats = self.versions[version] = VersionStats(version)
            if len(self.versions) > self.dashboard.max_versions:
                del self.versions[min(self.versions)]
        return stats

    def _changed(self, stats: VersionStats) -> None:
        stats.changed = self.dashboard.seq + 1

    def served(self, trajectory_id: str, version: int) -> None:
        """A logged call of this policy was served by ``version`` (the completion path)."""
        stats = self.versions.get(version) or self._version(version)
        stats.calls += 1
        self.calls += 1
        self._changed(stats)
        served = self.dashboard._served
        served[trajectory_id] = (self, version)
        if len(served) > self.dashboard.max_tracked:
            del served[next(iter(served))]

    def _rewarded(self, version: int, reward: float, now: float) -> None:
        stats = self._version(version)
        self._changed(stats)
        stats.rewards += 1
        stats.reward_sum += reward
        stats.reward_sq += reward * reward
        self.rewards += 1
        if not stats.first_reward:
            stats.first_reward = now

    def published(self, record: PolicyRecord) -> None:
        """A policy record read from the policy topic (the trainer's metrics of the step that made it)."""
        stats = self._version(record.version)
        stats.published, stats.trainer = record.created, dict(record.metrics)
        self._changed(stats)
        self.dashboard._bump()

    def evaluated(self, version: int, score: float, answered: int, problems: int) -> None:
        """A held-out evaluation of ``version`` (``producers/evaluate.py`` reports each one)."""
        stats = self._version(version)
        stats.eval = {"score": score, "answered": answered, "problems": problems, "time": time.time(),
                      "below_base": False}
        self._changed(stats)
        if version == 0:  # every evaluated version is judged against the base again (and sent again)
            self.base_score = score
            for other in self.versions.values():
                if other.eval is not None and other.version != 0:
                    other.eval["below_base"] = other.eval["score"] < score
                    self._changed(other)
        elif self.base_score is not None:
            stats.eval["below_base"] = score < self.base_score
        self.dashboard._bump()

    def routed(self, version: int, at: float) -> None:
        stats = self._version(version)
        stats.routed = at
        self._changed(stats)
        self.dashboard._bump()

    def warnings(self) -> list[dict[str, Any]]:
        """What the page shows above its charts, whole at every fetch: ``diverging`` when one of the newest
        ``RECENT_VERSIONS`` published versions was trained while the trainer judged itself diverging (its
        policy record's ``metrics["diverging"]``), ``below_base`` when the newest held-out evaluation scored
        below the base model's. With several policies each text names its policy."""
        out: list[dict[str, Any]] = []
        several = len(self.dashboard.boards) > 1
        of, named = (f" of {self.name}", f"{self.name} ") if several else ("", "")
        published = [self.versions[v] for v in sorted(self.versions) if self.versions[v].trainer]
        bad = [v for v in published[-RECENT_VERSIONS:] if v.trainer.get("diverging")]
        if bad:
            m = bad[-1].trainer
            names = ", ".join(f"v{v.version}" for v in bad)
            out.append({"kind": "diverging", "policy": self.name, "versions": [v.version for v in bad], "text": (
                f"Trainer{of} diverging: {names} trained while diverging (v{bad[-1].version}: KL "
                f"{m.get('kl_behaviour', math.nan):.3g} nats/token, mean ratio {m.get('ratio_mean', math.nan):.3g}, "
                f"clipped {m.get('truncated_frac', math.nan):.3g}, staleness {m.get('staleness_mean', math.nan):.1f}). "
                "The trainer's log names the likely cause: a learning rate too high for the model (lower "
                "learning_rate) or stale samples (lower max_lag).")})
        evaluated = [v for v in sorted(self.versions) if v and self.versions[v].eval is not None]
        if evaluated and self.base_score is not None:
            last = self.versions[evaluated[-1]].eval
            assert last is not None
            if last["below_base"]:
                out.append({"kind": "below_base", "policy": self.name, "versions": [evaluated[-1]], "text": (
                    f"Held-out score of {named}v{evaluated[-1]} ({last['score']:.3f}) is below the base model's "
                    f"({self.base_score:.3f}): training made the policy worse.")})
        return out

    def summary(self, counts: dict[str, float]) -> dict[str, Any]:
        """Its line of the snapshot's ``policies``: routed version now, and ``counts`` (its counters of the
        newest sample: calls by status, rewards naming it, swaps)."""
        routed = self.router.routed
        return {"name": self.name, "default": self is self.dashboard.default, "version": self.router.version,
                "served_name": routed.served_name if routed else None, "calls": self.calls, "rewards": self.rewards,
                "requests": counts.get("requests", 0.0), "requests_failed": counts.get("requests_failed", 0.0),
                "rewards_named": counts.get("rewards", 0.0), "swaps": counts.get("swaps", 0.0),
                "warnings": [w["kind"] for w in self.warnings()]}


class Dashboard:
    """The dashboard of every policy the gateway serves (``boards``, by name; the first is the default, the one
    shown when a viewer names none), and the gateway-wide samples."""

    def __init__(self, routers: PolicyRouter | Iterable[PolicyRouter], pool: UpstreamPool, metrics: GatewayMetrics,
                 producer_stats: Callable[[], ProducerStats | None], buffered: Callable[[], int], *,
                 max_versions: int = 2000, max_points: int = 3600, interval_s: float = 1.0,
                 max_tracked: int = 100_000) -> None:
        self.pool, self.metrics = pool, metrics
        self.producer_stats, self.buffered = producer_stats, buffered
        self.max_versions, self.max_tracked, self.interval_s = max_versions, max_tracked, interval_s
        self.boards: dict[str, PolicyBoard] = {
            r.name: PolicyBoard(self, r) for r in ([routers] if isinstance(routers, PolicyRouter) else routers)}
        if not self.boards:
            raise ValueError("the dashboard needs at least one policy")
        self.default = next(iter(self.boards.values()))
        self.router = self.default.router
        self.points: deque[dict[str, Any]] = deque(maxlen=max_points)
        self.seq = 0
        """Bumped at every change a viewer should fetch (a sample, a reward, a version)."""
        self.unattributed = 0
        """Rewards whose call this gateway did not serve (or served too long ago to remember, or for another
        policy than the one the reward names)."""
        self._served: dict[str, tuple[PolicyBoard, int]] = {}
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.started = time.time()

    def __iter__(self) -> Iterator[PolicyBoard]:
        return iter(self.boards.values())

    def board(self, policy: str | None = None) -> PolicyBoard:
        """The board of ``policy`` (the default one's for None); KeyError for a policy not served here."""
        return self.default if policy is None else self.boards[policy]

    @property
    def versions(self) -> dict[int, VersionStats]:
        """The default policy's versions."""
        return self.default.versions

    # -- updates from the gateway's own paths --------------------------------------------------------
    def served(self, trajectory_id: str, version: int, policy: str | None = None) -> None:
        """A logged call of ``policy`` (None: the default one) was served by ``version`` (the completion path)."""
        board = self.default if policy is None else self.boards.get(policy)
        if board is not None:
            board.served(trajectory_id, version)

    def rewarded(self, records: Iterable[RewardRecord]) -> None:
        """Rewards accepted by ``POST /v1/rewards``: each counts for the version that served its call, of the
        policy that served it (a reward naming another policy counts for none: that policy's trainer skips it)."""
        now = time.time()
        served = self._served
        for r in records:
            found = served.get(r.trajectory_id)
            if found is None or (r.policy is not None and r.policy != found[0].name):
                self.unattributed += 1
                continue
            del served[r.trajectory_id]
            found[0]._rewarded(found[1], r.reward, now)
        self._bump()

    def published(self, record: PolicyRecord) -> None:
        """A policy record (of a policy served here; others are ignored)."""
        board = self.boards.get(record.name)
        if board is not None:
            board.published(record)

    def evaluated(self, version: int, score: float, answered: int, problems: int, policy: str | None = None) -> None:
        """A held-out evaluation of ``version`` of ``policy`` (None: the default one)."""
        self.board(policy).evaluated(version, score, answered, problems)

    def routed(self, version: int, at: float, policy: str | None = None) -> None:
        self.board(policy).routed(version, at)

    def _bump(self) -> None:
        self.seq += 1
        self._changed.set()

    # -- the sampler ---------------------------------------------------------------------------------
    def _counters(self) -> dict[str, Any]:
        """The request, token and reward counters, read through the registry's public ``collect``; per policy
        (``policies``) its calls by status, the rewards naming it and its swaps."""
        out: dict[str, Any] = {"requests": 0.0, "requests_failed": 0.0, "rewards": 0.0, "prompt_tokens": 0.0,
                               "completion_tokens": 0.0}
        per = {name: {"requests": 0.0, "requests_failed": 0.0, "rewards": 0.0, "swaps": 0.0} for name in self.boards}
        for family in self.metrics.registry.collect():
            if family.name not in COUNTED:
                continue
            for s in family.samples:
                if s.name == "streamrl_gateway_requests_total":
                    out["requests"] += s.value
                    if s.labels["status"] >= "500":
                        out["requests_failed"] += s.value
                elif s.name == "streamrl_gateway_rewards_total":
                    out["rewards"] += s.value
                    if s.labels["policy"] in per:
                        per[s.labels["policy"]]["rewards"] += s.value
                elif s.name == "streamrl_gateway_tokens_total":
                    out[f"{s.labels['kind']}_tokens"] = s.value
                elif s.name == "streamrl_gateway_policy_requests_total" and s.labels["policy"] in per:
                    policy = per[s.labels["policy"]]
                    policy["requests"] += s.value
                    if s.labels["status"] >= "500":
                        policy["requests_failed"] += s.value
                elif s.name == "streamrl_gateway_policy_swaps_total" and s.labels["policy"] in per:
                    per[s.labels["policy"]]["swaps"] = s.value
        out["policies"] = per
        return out

    def sample(self) -> dict[str, Any]:
        stats = self.producer_stats()
        point: dict[str, Any] = {
            "time": time.time(),
            **self._counters(),
            "healthy_upstreams": sum(u.healthy for u in self.pool.upstreams),
            "upstreams": len(self.pool.upstreams),
            "in_flight": sum(u.in_flight for u in self.pool.upstreams),
            "version": self.router.version,
        }
        for board in self:
            point["policies"][board.name]["version"] = board.router.version
        if stats is not None:
            point.update({f"records_{k}": v for k, v in dataclasses.asdict(stats).items()})
            point["records_buffered"] = self.buffered()
        self.points.append(point)
        self._bump()
        return point

    async def _sampling(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._sampling())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def changed(self, seq: int, timeout_s: float) -> int:
        """Wait until something changed after ``seq`` (or the timeout); the current ``seq``."""
        if self.seq == seq:
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self._changed.wait()
        return self.seq

    # -- what a viewer fetches -----------------------------------------------------------------------
    def snapshot(self, since: float = 0.0, seq: int | None = None, policy: str | None = None) -> dict[str, Any]:
        """``policy``'s view (the default one's for None; KeyError for a policy not served here): its versions
        changed after ``seq`` (all without it) and the samples taken after ``since``, each with the policy's
        own counters as ``version`` and ``policy_*``; and every policy's line (``policies``). A viewer passes
        the last ``seq`` and sample time it has, and merges what comes by version."""
        board = self.board(policy)
        routed = board.router.routed
        last = self.points[-1]["policies"] if self.points else {}
        return {
            "seq": self.seq, "now": time.time(), "started": self.started, "interval_s": self.interval_s,
            "policy": {"name": board.name, "version": board.router.version,
                       "served_name": routed.served_name if routed else None},
            "policies": [b.summary(last.get(b.name, {})) for b in self],
            "upstreams": [{"url": u.url, "healthy": u.healthy, "in_flight": u.in_flight, "last_error": u.last_error,
                           "lora": u.lora} for u in self.pool.upstreams],
            "versions": [board.versions[v].view() for v in sorted(board.versions)
                         if seq is None or board.versions[v].changed > seq],
            "rewards_unattributed": self.unattributed,
            "points": [_of_policy(p, board.name) for p in self.points if p["time"] > since],
            "warnings": board.warnings(),
        }

    def warnings(self, policy: str | None = None) -> list[dict[str, Any]]:
        """``policy``'s warnings (``PolicyBoard.warnings``; the default one's for None)."""
        return self.board(policy).warnings()


def _of_policy(point: dict[str, Any], policy: str) -> dict[str, Any]:
    """A sample as one policy's viewer gets it: the gateway's counters, with ``version`` that policy's routed
    version and its own counters as ``policy_requests``, ``policy_requests_failed``, ``policy_rewards`` (those
    naming it) and ``policy_swaps``."""
    out = {k: v for k, v in point.items() if k != "policies"}
    own = point["policies"].get(policy, {})
    out["version"] = own.get("version", 0)
    for key in ("requests", "requests_failed", "rewards", "swaps"):
        out[f"policy_{key}"] = own.get(key, 0.0)
    return out
