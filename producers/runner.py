"""Drive an environment through the gateway: groups of trajectories, kept in flight, reward per version.

A group is one problem sampled ``group_size`` times (separate calls sharing a group id, each its own
trajectory), which is what the trainer's GRPO advantages are computed over. ``concurrency`` groups are
kept in flight so vLLM batches them. Every finished trajectory is booked under the policy version that
served it (the gateway's ``X-Policy-Version``), which shows the reward climbing version after version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from .client import AsyncGateway
from .episode import Outcome

log = logging.getLogger(__name__)


class Task(Protocol):
    def sample(self, rng: random.Random) -> Any:
        """A problem (a prompt, or a prompt with its answer) for one group."""

    async def episode(self, gateway: AsyncGateway, problem: Any, group_id: str, group_size: int) -> Outcome:
        """Play one trajectory through the gateway and post its reward."""


@dataclass
class VersionStats:
    n: int = 0
    total: float = 0.0
    total_sq: float = 0.0
    first_s: float = 0.0
    last_s: float = 0.0

    def add(self, reward: float, t: float) -> None:
        if self.n == 0:
            self.first_s = t
        self.n += 1
        self.total += reward
        self.total_sq += reward * reward
        self.last_s = t

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n else math.nan

    @property
    def std(self) -> float:
        if self.n < 2:
            return 0.0
        return math.sqrt(max(self.total_sq / self.n - self.mean**2, 0.0))


@dataclass
class Board:
    """Reward per served policy version, failed trajectories, and what to print."""

    started: float = field(default_factory=time.monotonic)
    started_at: float = field(default_factory=time.time)
    """Wall-clock start (epoch seconds), to line the board up with other logs."""
    versions: dict[int, VersionStats] = field(default_factory=dict)
    failed: int = 0
    groups: int = 0
    printed: set[int] = field(default_factory=set)
    target_reached_s: float | None = None
    """Seconds from the start until the reward target was reached (None: it was not)."""
    first_error: str | None = None
    """The first failed trajectory's exception, as ``Type: message``."""
    gave_up: bool = False
    """The run stopped because its first ``RunLimits.give_up_failures`` trajectories all failed."""
    reply_tokens: list[int] = field(default_factory=list)
    """Each finished trajectory's sampled tokens (where its responses said): the summary's exact reply lengths,
    which the trainer's per-step means cannot give (their max understates the longest reply)."""

    def add(self, outcome: Outcome) -> None:
        version = -1 if outcome.version is None else outcome.version
        self.versions.setdefault(version, VersionStats()).add(outcome.reward, time.monotonic() - self.started)
        if outcome.reply_tokens is not None:
            self.reply_tokens.append(outcome.reply_tokens)

    @property
    def newest(self) -> int:
        return max(self.versions, default=-1)

    def line(self, version: int) -> str:
        s = self.versions[version]
        bar = "#" * round(20 * min(max(s.mean, 0.0), 1.0))
        name = "unknown" if version < 0 else f"v{version}"
        return (f"policy {name:>4}: reward {s.mean:.3f} ± {s.std:.3f}  {bar:<20}  "
                f"({s.n} trajectories, t={s.first_s:.0f}-{s.last_s:.0f} s)")

    def closed_lines(self) -> list[str]:
        """Lines for versions that a newer version has superseded and that were not printed yet."""
        out = []
        for v in sorted(self.versions):
            if v < self.newest and v not in self.printed:
                self.printed.add(v)
                out.append(self.line(v))
        return out

    def summary(self) -> dict[str, Any]:
        return {
            "versions": {str(v): {"n": s.n, "mean": s.mean, "std": s.std, "first_s": s.first_s, "last_s": s.last_s}
                         for v, s in sorted(self.versions.items())},
            "failed": self.failed,
            "groups": self.groups,
            "trajectories": sum(s.n for s in self.versions.values()),
            "started_at": self.started_at,
            "seconds": time.monotonic() - self.started,
            "target_reached_s": self.target_reached_s,
            "first_error": self.first_error,
            "gave_up": self.gave_up,
            "reply_tokens": reply_token_stats(self.reply_tokens),
        }


def reply_token_stats(lengths: list[int]) -> dict[str, int] | None:
    """p50 / p90 (nearest rank: a length that occurred) / max of reply lengths and their count; None for
    none, so that a reader falls back to its own estimate rather than taking empty figures."""
    if not lengths:
        return None
    ranked = sorted(lengths)

    def rank(q: float) -> int:
        return ranked[max(0, math.ceil(q * len(ranked)) - 1)]

    return {"p50": rank(0.5), "p90": rank(0.9), "max": ranked[-1], "n": len(ranked)}


async def gateway_version(http: httpx.AsyncClient, url: str, policy_name: str | None = None) -> int | None:
    """The policy version the gateway routes its policy name to now (``GET /health``), None if unknown
    (or, with ``policy_name``, if the gateway serves another policy). Another policy than the gateway's default
    is read from the health detail's ``policies`` (a gateway without API keys, or an admin key, shows it)."""
    try:
        health = (await http.get(f"{url.rstrip('/')}/health")).json()
        policy = (health.get("policies") or {}).get(policy_name) or health.get("policy") or {}
        version = policy.get("version")
        if policy_name is not None and policy.get("name") != policy_name:
            return None
        return version if isinstance(version, int) else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None


def describe(exc: BaseException) -> str:
    """``Type: message``, with the innermost cause's message where it says more: the OpenAI client reports a
    refused connection as "Request timed out." (httpx-aiohttp maps aiohttp's connector errors to a connect
    timeout), and only the cause names the host it could not reach."""
    text = f"{type(exc).__name__}: {exc}"
    inner, seen = exc, {id(exc)}
    while (nxt := inner.__cause__ or inner.__context__) is not None and id(nxt) not in seen:
        inner = nxt
        seen.add(id(inner))
    said = str(inner).strip().splitlines()[0] if str(inner).strip() else ""
    return f"{text} ({said})" if inner is not exc and said and said not in text else text


def trainable(rewards: list[float], group_size: int) -> bool:
    """Whether the trainer can learn from a finished group: every trajectory rewarded, and not all
    rewards equal (GRPO advantages would all be zero; the trainer skips such groups)."""
    return len(rewards) == group_size and max(rewards) != min(rewards)


class VersionWatch:
    """The version the gateway routes now, asked by one task for every waiting group (``GET /health``
    every ``poll_s``): a waiting group reads ``version`` and costs neither side a request. Waiters
    polling the gateway themselves (64 groups at 20 Hz) took most of the producer's CPU and slowed
    every trajectory behind them."""

    def __init__(self, http: httpx.AsyncClient, url: str, poll_s: float = 0.1,
                 on_change: Callable[[], None] | None = None) -> None:
        self.http, self.url, self.poll_s, self.on_change = http, url, poll_s, on_change
        self.version: int | None = None

    async def run(self, done: asyncio.Event) -> None:
        while not done.is_set():
            version = await gateway_version(self.http, self.url)
            if version != self.version:
                self.version = version
                if self.on_change is not None:
                    self.on_change()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.poll_s):
                    await done.wait()


@dataclass
class Pacer:
    """Bounded off-policyness (the rule AReaL uses): a new group starts only while the groups started so
    far are at most ``(v - v0 + 1 + max_ahead) * groups_per_step``, v being the version the gateway
    serves now and v0 the one it served at the start. Generation then runs at most ``max_ahead`` steps
    ahead of training, so samples are at most about that many versions stale, whatever the speed ratio
    of inference and training. A finished group the trainer cannot use (a failed trajectory, or equal
    rewards: no learning signal, which the trainer skips) is refunded at once, so the step still gets
    its groups; when the version does not move for ``stall_s`` anyway (the trainer dropped groups for
    another reason) one more group is let through, so nothing deadlocks.

    Waiters sleep until ``kick`` (a new version; a refund) or the stall time, and re-check then."""

    groups_per_step: int
    max_ahead: int = 1
    stall_s: float = 3.0
    started: int = 0
    first_version: int | None = None
    last_grant: float = field(default_factory=time.monotonic)
    _kicked: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)

    def allowance(self, version: int) -> int:
        if self.first_version is None:
            self.first_version = version
        return (version - self.first_version + 1 + self.max_ahead) * self.groups_per_step

    async def acquire(self, served_version: Callable[[], int | None], done: asyncio.Event) -> bool:
        """Wait for a group's turn; False when the run ends first. ``served_version`` says which version
        the gateway serves now (``VersionWatch.version``)."""
        while not done.is_set():
            self._kicked.clear()  # nothing awaits between this check and the wait: no kick is missed
            version = served_version()
            stalled_for = time.monotonic() - self.last_grant
            if version is None or self.started < self.allowance(version) or stalled_for > self.stall_s:
                self.started += 1
                self.last_grant = time.monotonic()
                return True
            with contextlib.suppress(TimeoutError):  # bounded, so that ``done`` is seen too
                async with asyncio.timeout(min(self.stall_s - stalled_for, 0.5) + 1e-3):
                    await self._kicked.wait()
        return False

    def kick(self) -> None:
        """Wake the waiters to re-check: the version moved, or a group was refunded."""
        self._kicked.set()

    def refund(self) -> None:
        """Give back a started group that will not count towards a training step."""
        self.started -= 1
        self.kick()


@dataclass(frozen=True, slots=True)
class RunLimits:
    """When to stop, whichever comes first: ``stop_groups`` whole groups served by version
    ``until_version`` or later; the last ``stop_groups`` groups, all served by trained versions (>= 1),
    average ``until_reward`` or more; ``max_seconds``; ``give_up_failures`` trajectories failed before any
    finished (a task whose episodes cannot run, e.g. a tool server that cannot start, then ends the run at once
    with its first error instead of failing every episode until the time limit; 0: never)."""

    until_version: int | None = None
    until_reward: float | None = None
    stop_groups: int = 4
    max_seconds: float | None = None
    give_up_failures: int = 64


async def run_groups(url: str, task: Task, *, group_size: int = 8, concurrency: int = 4,
                     limits: RunLimits = RunLimits(), pacer: Pacer | None = None,
                     stop: threading.Event | None = None, seed: int = 0,
                     emit: Callable[[str], None] = print, stop_grace_s: float = 2.0) -> Board:
    """Keep up to ``concurrency`` groups in flight (as far as ``pacer`` allows) until a limit is reached
    or ``stop`` is set. At a limit the groups in flight are finished (their rewards posted); after ``stop``
    they get ``stop_grace_s`` and are abandoned then (their completions are logged; their group is never
    completed, so the trainer drops it)."""
    board = Board()
    rng = random.Random(seed)
    done = asyncio.Event()
    late_groups = 0
    recent: deque[tuple[int, float]] = deque(maxlen=limits.stop_groups)  # (oldest version, mean reward)

    async def one_group() -> None:
        nonlocal late_groups
        group_id = f"g-{uuid.uuid4().hex[:12]}"
        problem = task.sample(rng)
        results = await asyncio.gather(*(task.episode(gateway, problem, group_id, group_size)
                                         for _ in range(group_size)), return_exceptions=True)
        board.groups += 1
        versions, rewards = [], []
        for r in results:
            if isinstance(r, BaseException):
                board.failed += 1
                board.first_error = board.first_error or describe(r)
                if board.failed <= 5:  # the count is in the summary; the first few say why
                    log.warning("trajectory failed: %s", describe(r))
            else:
                board.add(r)
                versions.append(-1 if r.version is None else r.version)
                rewards.append(r.reward)
        for text in board.closed_lines():
            emit(text)
        if limits.give_up_failures and board.failed >= limits.give_up_failures and not board.versions \
                and not done.is_set():
            emit(f"every one of the first {board.failed} trajectories failed, none finished: stopping "
                 f"(the first error: {board.first_error})")
            board.gave_up = True
            done.set()
        if pacer is not None and not trainable(rewards, group_size):
            pacer.refund()
        if not versions or len(versions) < group_size:
            return
        if limits.until_version is not None and min(versions) >= limits.until_version:
            late_groups += 1
            if late_groups >= limits.stop_groups:
                done.set()
        recent.append((min(versions), sum(rewards) / len(rewards)))
        if limits.until_reward is not None and len(recent) == limits.stop_groups and not done.is_set() \
                and min(v for v, _ in recent) >= 1 \
                and sum(m for _, m in recent) / len(recent) >= limits.until_reward:
            emit(f"reward target {limits.until_reward} reached: the last {len(recent)} groups "
                 f"(policy v{min(versions)}) averaged {sum(m for _, m in recent) / len(recent):.3f}")
            board.target_reached_s = time.monotonic() - board.started
            done.set()

    async def worker() -> None:
        while not done.is_set():
            if pacer is not None and not await pacer.acquire(lambda: watch.version, done):
                break
            await one_group()

    async def limit() -> None:
        while not done.is_set():
            if stop is not None and stop.is_set():
                break
            if limits.max_seconds is not None and time.monotonic() - board.started > limits.max_seconds:
                emit(f"time limit of {limits.max_seconds:.0f} s reached")
                break
            await asyncio.sleep(0.2)
        done.set()

    async with AsyncGateway(url, max_connections=max(64, 2 * concurrency * group_size)) as gateway:
        watch = VersionWatch(gateway.http, url, on_change=pacer.kick if pacer is not None else None)
        watching = asyncio.create_task(watch.run(done)) if pacer is not None else None
        workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
        await limit()
        stopped = stop is not None and stop.is_set()
        _, pending = await asyncio.wait(workers, timeout=stop_grace_s if stopped else None)
        for w in pending:  # told to stop: groups still running after the grace are abandoned
            w.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if watching is not None:
            await watching
    if board.versions:
        emit(board.line(board.newest))
    emit(f"{board.groups} groups, {sum(s.n for s in board.versions.values())} trajectories, "
         f"{board.failed} failed, {time.monotonic() - board.started:.0f} s")
    return board
