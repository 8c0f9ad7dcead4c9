"""The trainer's per-step batch metrics: staleness per sampled token as a histogram, beside the numbers."""

from __future__ import annotations

import numpy as np
import pytest

from streamrl.trainer.batch import GroupBatch, TrainSequence
from streamrl.trainer.metrics import batch_metrics
from streamrl.trainer.tracking import numbers


def sequence(version: int, sampled: int, prompt: int = 3, reward: float = 0.0, trajectory: str = "t") -> TrainSequence:
    """A sequence of ``prompt`` prompt tokens then ``sampled`` sampled ones, sampled by ``version``."""
    n = prompt + sampled
    mask = np.array([0] * prompt + [1] * sampled, np.int8)
    return TrainSequence(np.zeros(n, np.int32), mask, np.zeros(n, np.float32), 0.0, policy_version=version,
                         reward=reward, trajectory_id=trajectory)


def test_staleness_tokens_count_sampled_tokens_by_staleness() -> None:
    """Trained into version 5 (the trainer at 5): sequences of versions 5, 4 and 2 are 0, 1 and 3 behind."""
    batches = [GroupBatch("g1", [sequence(5, 10, reward=1.0, trajectory="a"), sequence(4, 7, trajectory="b")]),
               GroupBatch("g2", [sequence(5, 2, prompt=40, reward=1.0, trajectory="c"),
                                 sequence(2, 30, trajectory="d")])]
    m = batch_metrics(batches, 5)
    assert m["staleness_tokens"] == {"0": 12, "1": 7, "3": 30}  # prompt tokens are not sampled: not counted
    assert list(m["staleness_tokens"]) == ["0", "1", "3"]
    assert m["staleness_mean"] == pytest.approx(1.0) and m["staleness_max"] == 3.0  # per sequence, as before
    assert m["reward_mean"] == 0.5 and m["trajectories"] == 4
    assert "staleness_tokens" not in numbers(m)  # trackers (and /metrics, the policy record) take numbers only
