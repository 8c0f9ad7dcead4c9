"""Join completions and rewards by trajectory id into reward-tagged groups, with bounded memory.

Rules (each outcome is counted in ``Assembler.counts``):

* A trajectory joins its group when its reward arrives. Group id: the reward's, else the completion's,
  else the trajectory id. Group size: the reward's ``group_size``, else the configured default.
* A group is ``ready`` when ``group_size`` of its trajectories have a reward and at least one
  completion. Rewards may arrive before completions: the trajectory waits until a completion comes.
* A group older than ``group_timeout_s`` is trained on what it has when that is at least two
  trajectories (``incomplete_trained``), else dropped (``incomplete_dropped``).
* Duplicate reward for a trajectory: **the first one wins** (log order, deterministic on replay);
  later ones are counted ``duplicate_reward`` and ignored. A duplicate completion (same request id and
  choice index) is counted ``duplicate_completion`` and ignored.
* A completion of another policy (several on one fleet) is counted ``other_policy`` and skipped with its
  trajectory's reward; a reward that names another policy (``RewardRecord.policy``: its poster's key is
  limited to that policy) is counted ``other_policy_reward`` and skipped, whatever trajectory it names.
* A completion generated for another purpose than training (``purpose`` ``eval``: held-out evaluation)
  is counted ``not_trained_eval`` and never held.
* Completions without a reward, and rewards without completions, expire after ``ttl_s``
  (``expired_completions`` / ``expired_rewards``). Beyond ``max_trajectories`` the oldest trajectory is
  evicted (``evicted``). Records for a group already trained are ``late`` and ignored.

Every held record keeps its raw Kafka bytes, so the trainer can checkpoint exactly what it has consumed
but not yet trained (see trainer/state.py) and rebuild the assembler after a restart.
"""

from __future__ import annotations

import math
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import numpy as np

from streamrl.broker.schema import CompletionRecord, RewardRecord, token_versions

COMPLETION, REWARD = "c", "r"


@dataclass
class Trajectory:
    trajectory_id: str
    first_seen: float
    completions: list[CompletionRecord] = field(default_factory=list)
    reward: RewardRecord | None = None
    raw: list[tuple[str, bytes]] = field(default_factory=list)
    """(stream, value bytes) of every record held for this trajectory, in arrival order."""
    _merged: tuple[int, list[Sequence]] | None = field(default=None, repr=False, compare=False)

    def sequences(self) -> list[Sequence]:
        """``merge_calls`` of the completions, worked out once per set of completions: a ready group is
        judged again at each new version and then batched, all from the same merge."""
        if self._merged is None or self._merged[0] != len(self.completions):
            self._merged = (len(self.completions), merge_calls(self.completions))
        return self._merged[1]

    @property
    def group_id(self) -> str:
        if self.reward is not None and self.reward.group_id:
            return self.reward.group_id
        for c in self.completions:
            if c.group_id:
                return c.group_id
        return self.trajectory_id

    @property
    def usable(self) -> bool:
        return self.reward is not None and bool(self.completions)


@dataclass
class Group:
    group_id: str
    size: int
    first_seen: float
    members: list[str] = field(default_factory=list)


@dataclass
class ReadyGroup:
    """A group handed to the trainer: its usable trajectories, rewards attached."""

    group_id: str
    trajectories: list[Trajectory]
    complete: bool

    @property
    def raw(self) -> list[tuple[str, bytes]]:
        return [r for t in self.trajectories for r in t.raw]


@dataclass
class Sequence:
    """One training sequence: tokens, which of them were sampled, and their behaviour logprobs. The mask and
    the logprobs are kept as the calls gave them (span lengths, each call's logprobs) until the step's batch
    writes every sequence's into its Arrow buffers at once (``batch.step_batch``)."""

    token_ids: np.ndarray
    spans: list[int]
    """Lengths of the sequence's alternating unsampled (prompt, tool results) and sampled spans, unsampled first."""
    sampled_logprobs: list[np.ndarray]
    """The sampler's logprobs of each sampled span (float32)."""
    request_ids: list[str]
    policy_version: int
    """The oldest version among the sampled tokens of the calls merged into this sequence."""
    temperature: float = 1.0
    """The sampling temperature of its calls (all equal: a change of temperature starts a new sequence)."""
    sampled_versions: list[np.ndarray] | None = None
    """The version that sampled each token of each sampled span (int32; ``token_versions`` of its call's
    record); None: every sampled token came from ``policy_version``."""

    @property
    def newest_version(self) -> int:
        """The newest version among the sampled tokens (staleness is judged per token: ``batch.usable_group``)."""
        if not self.sampled_versions:
            return self.policy_version
        return max((int(v.max()) for v in self.sampled_versions if v.size), default=self.policy_version)

    @property
    def loss_mask(self) -> np.ndarray:
        """1 where the token was sampled (int8)."""
        return span_mask(self.spans)

    @property
    def behaviour_logprobs(self) -> np.ndarray:
        """The sampler's logprob of each sampled token, 0 elsewhere (float32)."""
        out = np.zeros(len(self.token_ids), np.float32)
        out[self.loss_mask == 1] = np.concatenate(self.sampled_logprobs)
        return out


def span_mask(spans: list[int]) -> np.ndarray:
    """The loss mask of alternating unsampled / sampled span lengths (int8)."""
    return np.repeat(np.tile(np.array([0, 1], np.int8), len(spans) // 2), spans)


GREEDY_BELOW = 1e-5
"""vLLM samples greedily (argmax) at temperatures below this (its ``_SAMPLING_EPS``)."""


def sampling_temperature(record: CompletionRecord) -> float:
    """The temperature the call was sampled at: the request's ``temperature``, else 1.0.

    1.0 is vLLM's default when a request omits it, unless the served model's ``generation_config``
    sets another default (vLLM's ``--generation-config auto``); the trainer assumes it does not. A
    gateway with ``record_request = false`` keeps no request body, so every call then counts as 1.0.
    NaN when the value is unusable (not a finite number >= 0), so that the trajectory is skipped.
    """
    t = record.request.get("temperature") if isinstance(record.request, dict) else None
    if t is None:
        return 1.0
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
        return math.nan
    return float(t)


def filtered_sampling(record: CompletionRecord) -> bool:
    """Whether the call was sampled from a truncated distribution (top_p < 1, top_k > 0 or min_p > 0)."""
    r = record.request if isinstance(record.request, dict) else {}

    def num(key: str, default: float) -> float:
        v = r.get(key)
        return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else default

    return num("top_p", 1.0) < 1.0 or num("top_k", -1) > 0 or num("min_p", 0.0) > 0.0


@dataclass
class _Open:
    """A sequence being built by ``merge_calls``: its tokens so far (what a continuation starts with), its
    spans and sampled logprobs."""

    spans: list[int]
    logprobs: list[np.ndarray]
    current: np.ndarray
    request_ids: list[str]
    version: int
    temperature: float
    versions: list[np.ndarray] = field(default_factory=list)

    def extend(self, prompt_tail: np.ndarray, completion: np.ndarray, logprobs: np.ndarray,
               versions: np.ndarray) -> None:
        self.spans += [len(prompt_tail), len(completion)]
        self.logprobs.append(logprobs.astype(np.float32, copy=False))
        self.versions.append(versions)
        self.current = np.concatenate([self.current, prompt_tail, completion])

    def continued_by(self, prompt: np.ndarray, temperature: float) -> bool:
        n = len(self.current)
        return temperature == self.temperature and len(prompt) >= n and np.array_equal(prompt[:n], self.current)

    def sequence(self) -> Sequence:
        return Sequence(self.current.astype(np.int32, copy=False), self.spans, self.logprobs, self.request_ids,
                        self.version, self.temperature, self.versions)


def merge_calls(completions: list[CompletionRecord]) -> list[Sequence]:
    """Turn a trajectory's calls into training sequences.

    A call whose prompt starts with a sequence's tokens so far (its calls' prompts and completions), and
    that was sampled at the same temperature, continues that sequence (the longest such one): the new
    prompt tokens (tool results, the next user turn) join unmasked, the sampled tokens masked in.
    Otherwise the call starts a new sequence.

    Calls are taken by prompt length (stable: equal lengths keep log order), not by log order alone: a
    continuation's prompt holds its predecessor's whole prompt and completion, so it is always longer,
    while the log may hold them the other way round when a trajectory's calls went through different
    gateways, each with its own producer. No clock is trusted for this.
    """
    open_: list[_Open] = []
    for c in sorted(completions, key=lambda c: len(c.prompt_token_ids)):
        p, temp = c.prompt_token_ids, sampling_temperature(c)
        versions = token_versions(c)
        oldest = int(versions.min()) if versions.size else c.policy_version
        into = max((o for o in open_ if o.continued_by(p, temp)), key=lambda o: len(o.current), default=None)
        if into is None:
            into = _Open([], [], np.empty(0, np.int32), [c.request_id], oldest, temp)
            open_.append(into)
        else:
            into.request_ids = [*into.request_ids, c.request_id]
            into.version = min(into.version, oldest)
        into.extend(p[len(into.current):], c.completion_token_ids, c.logprobs, versions)
    return [o.sequence() for o in open_]


class Assembler:
    """Holds trajectories and groups until they are ready; ``poll()`` returns what became ready."""

    def __init__(self, *, group_size: int, group_timeout_s: float, ttl_s: float,
                 max_trajectories: int, max_done_groups: int = 100_000, policy: str | None = None) -> None:
        self.policy = policy
        """Completions that name another policy (several on one fleet) are not this trainer's: counted
        ``other_policy`` and skipped with their trajectory's reward. None: every policy's."""
        self.others: OrderedDict[str, None] = OrderedDict()
        """Trajectory and group ids of other policies' completions (bounded like ``done``)."""
        self.group_size = group_size
        self.group_timeout_s = group_timeout_s
        self.ttl_s = ttl_s
        self.max_trajectories = max_trajectories
        self.max_done_groups = max_done_groups
        self.trajectories: OrderedDict[str, Trajectory] = OrderedDict()
        self.groups: dict[str, Group] = {}
        self.done: OrderedDict[str, None] = OrderedDict()
        """Ids of closed groups and of their trajectories (bounded, oldest forgotten first)."""
        self.counts: Counter[str] = Counter()
        self._ready: list[ReadyGroup] = []
        self._seen_requests: dict[str, set[tuple[str, int]]] = {}

    # ---- input -----------------------------------------------------------------------------
    def add(self, record: CompletionRecord | RewardRecord, raw: bytes, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if isinstance(record, CompletionRecord):
            self._add_completion(record, raw, now)
        else:
            self._add_reward(record, raw, now)

    def _trajectory(self, trajectory_id: str, now: float) -> Trajectory:
        t = self.trajectories.get(trajectory_id)
        if t is None:
            t = self.trajectories[trajectory_id] = Trajectory(trajectory_id, now)
            while len(self.trajectories) > self.max_trajectories:
                self._forget(next(iter(self.trajectories)), "evicted")
        return t

    def _add_completion(self, rec: CompletionRecord, raw: bytes, now: float) -> None:
        if rec.purpose != "train":  # an evaluation of a version (held-out problems): never trained on
            self.counts[f"not_trained_{rec.purpose}"] += 1
            return
        if self.policy is not None and rec.policy_name is not None and rec.policy_name != self.policy:
            self._other(rec.trajectory_id, rec.group_id)
            return
        if rec.group_id in self.done or rec.trajectory_id in self.done:
            self.counts["late"] += 1
            return
        key = (rec.request_id, rec.choice_index)
        seen = self._seen_requests.setdefault(rec.trajectory_id, set())
        if key in seen:
            self.counts["duplicate_completion"] += 1
            return
        seen.add(key)
        t = self._trajectory(rec.trajectory_id, now)
        t.completions.append(rec)
        t.raw.append((COMPLETION, raw))
        self.counts["completions"] += 1
        if t.reward is not None:
            self._check(t.group_id, now)

    def _other(self, trajectory_id: str, group_id: str | None) -> None:
        """Another policy's trajectory: remembered, so that its reward is skipped too; a reward of it that came
        first is dropped, and its group with it (a group is one policy's)."""
        self.counts["other_policy"] += 1
        for key in (trajectory_id, group_id):
            if key:
                self.others[key] = None
        while len(self.others) > self.max_done_groups:
            self.others.popitem(last=False)
        t = self.trajectories.get(trajectory_id)
        if t is not None and t.reward is not None:  # (that reward was counted when read: once is enough)
            g = self.groups.get(t.group_id)
            if g is not None:
                g.members = [m for m in g.members if m != trajectory_id]
                if not g.members:
                    del self.groups[g.group_id]
        self._forget(trajectory_id, None)

    def _add_reward(self, rec: RewardRecord, raw: bytes, now: float) -> None:
        gid_hint = rec.group_id or rec.trajectory_id
        if self.policy is not None and rec.policy is not None and rec.policy != self.policy:
            self.counts["other_policy_reward"] += 1  # posted for another policy (its key's): never this one's
            return
        if rec.trajectory_id in self.others or gid_hint in self.others:
            self.counts["other_policy"] += 1
            return
        if gid_hint in self.done:
            self.counts["late"] += 1
            return
        t = self._trajectory(rec.trajectory_id, now)
        if t.reward is not None:
            self.counts["duplicate_reward"] += 1
            return
        t.reward = rec
        t.raw.append((REWARD, raw))
        self.counts["rewards"] += 1
        gid = t.group_id
        if gid in self.done:
            self.counts["late"] += 1
            self._forget(t.trajectory_id, None)
            return
        g = self.groups.get(gid)
        if g is None:
            g = self.groups[gid] = Group(gid, rec.group_size or self.group_size, now)
        g.members.append(t.trajectory_id)
        self._check(gid, now)

    # ---- output ----------------------------------------------------------------------------
    def _usable(self, g: Group) -> list[Trajectory]:
        return [self.trajectories[m] for m in g.members if m in self.trajectories and self.trajectories[m].usable]

    def _check(self, gid: str, now: float) -> None:
        g = self.groups.get(gid)
        if g is not None and len(self._usable(g)) >= g.size:
            self._release(g, complete=True)

    def _release(self, g: Group, *, complete: bool) -> None:
        members = self._usable(g)
        self._ready.append(ReadyGroup(g.group_id, members, complete))
        self.counts["groups_ready" if complete else "incomplete_trained"] += 1
        self._close(g)

    def _close(self, g: Group) -> None:
        for m in g.members:
            self._forget(m, None)
            self.done[m] = None
        del self.groups[g.group_id]
        self.done[g.group_id] = None
        while len(self.done) > self.max_done_groups:
            self.done.popitem(last=False)

    def _forget(self, trajectory_id: str, reason: str | None) -> None:
        t = self.trajectories.pop(trajectory_id, None)
        self._seen_requests.pop(trajectory_id, None)
        if t is not None and reason:
            self.counts[reason] += 1

    def poll(self, now: float | None = None) -> list[ReadyGroup]:
        """Apply timeouts and TTLs, then return (and hand over) the groups that became ready."""
        now = time.monotonic() if now is None else now
        for g in [g for g in self.groups.values() if now - g.first_seen >= self.group_timeout_s]:
            if len(self._usable(g)) >= 2:
                self._release(g, complete=False)
            else:
                self.counts["incomplete_dropped"] += 1
                self._close(g)
        for t in [t for t in self.trajectories.values() if now - t.first_seen >= self.ttl_s]:
            if t.reward is None:
                self._forget(t.trajectory_id, "expired_completions")
            elif not t.completions and t.group_id not in self.groups:
                self._forget(t.trajectory_id, "expired_rewards")
        ready, self._ready = self._ready, []
        return ready

    def pending_raw(self) -> list[tuple[str, bytes]]:
        """Raw records held but not yet handed over, for the checkpoint."""
        return [r for t in self.trajectories.values() for r in t.raw]

    def mark_done(self, group_ids: list[str]) -> None:
        """Groups already trained (restored from a checkpoint): their late records are ignored."""
        for gid in group_ids:
            self.done[gid] = None
