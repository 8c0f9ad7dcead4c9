"""Complete groups from the log: trajectories' calls (completions topic) and judge requests (rewards topic).

Rules (each outcome counted in ``GroupBook.counts``):

* A trajectory is judged when its ``JudgeRequest`` has come and it has at least one recorded call. Its
  group is the request's ``group_id``, else the trajectory id.
* A group is complete when ``group_size`` (the first request that says one) requests have come and no
  record for it came for ``settle_s`` (a multi-turn trajectory's last call may be logged after its request),
  or, when no request says a size, after ``quiet_period_s`` without a new record for it. A complete group whose members' calls
  have not all come waits for them up to the quiet period; then the members with calls are judged and the
  rest counted ``no_completions``.
* A trajectory with a reward of this judge's own (``judged_by``) is done: its request, met again after a
  restart, is counted ``already_judged`` and never judged twice. A reward posted by a producer means the
  trajectory needs no judge: its calls are forgotten.
* Calls of trajectories without a request expire after ``ttl_s`` (``expired``); beyond ``max_trajectories``
  the oldest are forgotten (``evicted``). Judge and eval calls are never held (``not_judged_<purpose>``).

Every held record remembers its partition and offset: ``low_watermark`` is how far offsets may be
committed so that a restart re-reads everything held (and so rebuilds this book) and nothing else.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field

from streamrl.broker.schema import CompletionRecord, JudgeRequest, RewardRecord

from .render import Call


@dataclass
class Held:
    trajectory_id: str
    first_seen: float
    calls: list[Call] = field(default_factory=list)
    request: JudgeRequest | None = None
    offsets: list[tuple[str, int]] = field(default_factory=list)
    """(partition key, offset) of every record held for it."""
    in_flight: bool = False


@dataclass
class PendingGroup:
    group_id: str
    first: JudgeRequest
    """The group's first request: its ``weight`` is the group's mixing rule."""
    last_activity: float
    size: int | None = None
    requested: set[str] = field(default_factory=set)
    """Every trajectory a request came for (done ones too: they count towards ``size``)."""
    members: list[str] = field(default_factory=list)
    """Those still to judge, in request order."""


@dataclass
class ReadyGroup:
    group_id: str
    first: JudgeRequest
    members: list[Held]
    already_rewarded: int
    """Members of the group rewarded by this judge before (a restart in the middle of posting)."""


class GroupBook:
    def __init__(self, judge_id: str, *, quiet_period_s: float, ttl_s: float, max_trajectories: int,
                 settle_s: float = 0.0) -> None:
        self.judge_id, self.settle_s = judge_id, settle_s
        self.quiet_period_s, self.ttl_s, self.max_trajectories = quiet_period_s, ttl_s, max_trajectories
        self.held: OrderedDict[str, Held] = OrderedDict()
        self.groups: dict[str, PendingGroup] = {}
        self.done: OrderedDict[str, None] = OrderedDict()
        """Trajectories rewarded (by this judge or their producer), bounded, oldest forgotten first."""
        self.counts: Counter[str] = Counter()

    def _held(self, tid: str, now: float) -> Held:
        h = self.held.get(tid)
        if h is None:
            h = self.held[tid] = Held(tid, now)
            while len(self.held) > self.max_trajectories:
                oldest = next(iter(self.held.values()))
                if oldest.request is not None:
                    break  # requested trajectories are never evicted: their offsets hold the restart point
                self._forget(oldest.trajectory_id, "evicted")
        return h

    def _mark_done(self, tid: str) -> None:
        self.done[tid] = None
        while len(self.done) > 4 * self.max_trajectories:
            self.done.popitem(last=False)

    def _touch(self, h: Held, now: float) -> None:
        if h.request is not None:
            g = self.groups.get(h.request.group_id or h.trajectory_id)
            if g is not None:
                g.last_activity = now

    def add_completion(self, rec: CompletionRecord, where: tuple[str, int], now: float) -> None:
        if rec.purpose != "train":
            self.counts[f"not_judged_{rec.purpose}"] += 1
            return
        if rec.trajectory_id in self.done:
            self.counts["late_completion"] += 1
            return
        h = self._held(rec.trajectory_id, now)
        if h.in_flight:
            self.counts["late_completion"] += 1
            return
        h.calls.append(Call.of(rec))
        h.offsets.append(where)
        self.counts["completions"] += 1
        self._touch(h, now)

    def add_request(self, req: JudgeRequest, where: tuple[str, int], now: float) -> None:
        tid, gid = req.trajectory_id, req.group_id or req.trajectory_id
        if tid in self.done:
            self.counts["already_judged"] += 1
            return
        h = self._held(tid, now)
        if h.request is not None:
            self.counts["duplicate_request"] += 1
            return
        h.request = req
        h.offsets.append(where)
        self.counts["requests"] += 1
        g = self.groups.get(gid)
        if g is None:
            g = self.groups[gid] = PendingGroup(gid, req, now)
        if g.size is None and req.group_size is not None:
            g.size = req.group_size
        g.requested.add(tid)
        g.members.append(tid)
        g.last_activity = now

    def add_reward(self, rec: RewardRecord, now: float) -> None:
        tid = rec.trajectory_id
        mine = rec.judged_by == self.judge_id
        h = self.held.get(tid)
        if not mine and h is not None and h.request is not None:
            self.counts["producer_reward_ignored"] += 1  # it asked for the judge: the judge answers
            return
        if mine:
            self.counts["own_rewards_seen"] += 1
        self._mark_done(tid)
        if h is None or h.in_flight:
            return
        if h.request is not None:
            g = self.groups.get(h.request.group_id or tid)
            if g is not None and tid in g.members:
                g.members.remove(tid)
                if not g.members and g.size is not None and len(g.requested) >= g.size:
                    del self.groups[g.group_id]
        self._forget(tid, None)

    def _forget(self, tid: str, reason: str | None) -> None:
        if self.held.pop(tid, None) is not None and reason:
            self.counts[reason] += 1

    def ready(self, now: float) -> list[ReadyGroup]:
        """Groups complete now, taken out of the book (their records stay held until ``finish``)."""
        out = []
        for g in list(self.groups.values()):
            quiet = now - g.last_activity >= self.quiet_period_s
            if g.size is not None and len(g.requested) < g.size and not quiet:
                continue
            if now - g.last_activity < self.settle_s:
                continue
            if g.size is None and not quiet:
                continue
            members = [self.held[m] for m in g.members if m in self.held]
            if not quiet and any(not h.calls for h in members):
                continue  # complete by count; calls still on their way
            del self.groups[g.group_id]
            with_calls = [h for h in members if h.calls]
            for h in members:
                if not h.calls:
                    self.counts["no_completions"] += 1
                    self._forget(h.trajectory_id, None)
                    self._mark_done(h.trajectory_id)
            if not with_calls:
                continue
            for h in with_calls:
                h.in_flight = True
            rewarded = len(g.requested) - len(g.members)
            out.append(ReadyGroup(g.group_id, g.first, with_calls, rewarded))
        for h in [h for h in self.held.values() if h.request is None and now - h.first_seen >= self.ttl_s]:
            self._forget(h.trajectory_id, "expired")
        return out

    def finish(self, group: ReadyGroup) -> None:
        """The group's rewards are acknowledged (or it failed for good): its records are let go."""
        for h in group.members:
            self._forget(h.trajectory_id, None)
            self._mark_done(h.trajectory_id)

    def low_watermark(self, next_offsets: dict[str, int]) -> dict[str, int]:
        """Per partition, the offset from which a restart must read: the oldest record still held, else
        the next one to read."""
        out = dict(next_offsets)
        for h in self.held.values():
            for key, offset in h.offsets:
                if offset < out.get(key, offset + 1):
                    out[key] = offset
        return out
