"""An agent written with any framework, as a task the runner (``runner.run_groups``), the held-out
evaluation (``evaluate.Evaluator``) and ``streamrl up --demo --demo-task module:attr`` all drive.

A subclass says how to draw a problem (``sample``) and how to play one episode (``play``) with a trajectory
(``client.AsyncTrajectory``) whose ids the framework's calls must carry: pass ``t.client`` (an
``openai.AsyncOpenAI``) where the framework takes a client, or ``t.base_url``, ``t.headers`` and ``t.http``
where it builds its own. ``play`` returns the reward; this class posts it when the episode ends (or, for
an evaluation, scores it without posting), and reads the version that served it from the gateway's
responses (``t.version``), which a framework never shows its caller. See docs/loop.md, "Agents written
with frameworks".
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from .client import AsyncGateway, AsyncTrajectory
from .episode import Outcome


class AgentTask(ABC):
    """Subclasses set ``model`` (the name sent to the gateway), ``temperature`` and ``max_tokens`` (for the
    calls the framework makes), and ``held_out`` (problems never sampled for training; empty: no evaluation)."""

    model: str = "policy"
    temperature: float = 1.0
    max_tokens: int = 128
    held_out: Sequence[Any] = ()

    @abstractmethod
    def sample(self, rng: random.Random) -> Any:
        """A training problem for one group (never one of ``held_out``)."""

    @abstractmethod
    async def play(self, t: AsyncTrajectory, problem: Any, *, model: str, temperature: float) -> float | None:
        """Play one episode through the gateway with ``t``'s ids on every call; the reward, or None when the
        episode asked for judging instead (``t.judge(...)``)."""

    async def episode(self, gateway: AsyncGateway, problem: Any, group_id: str, group_size: int) -> Outcome:
        """One training trajectory: played, its reward posted when it ends (nothing when ``play`` raises)."""
        async with gateway.trajectory(group_id=group_id, group_size=group_size) as t:
            reward = await self.play(t, problem, model=self.model, temperature=self.temperature)
            if reward is not None:
                t.reward(reward, turns=t.calls)
            elif not t.has_reward:
                raise ValueError(f"{type(self).__name__}.play returned no reward and asked for no judging")
        return Outcome(0.0 if reward is None else reward, t.version, t.trajectory_id, t.calls)

    async def evaluate_problem(self, gateway: AsyncGateway, problem: Any, model: str, version: int) -> float | None:
        """One held-out episode pinned to ``model``, greedy, marked ``eval`` (recorded, never trained on),
        nothing posted; its score, or None when a call was answered by another version than ``version``."""
        async with gateway.trajectory(purpose="eval") as t:
            score = await self.play(t, problem, model=model, temperature=0.0)
        return None if score is None or t.version != version else score
