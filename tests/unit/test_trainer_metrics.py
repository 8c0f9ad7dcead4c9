"""The trainer's per-step batch metrics: staleness per sampled token as a histogram, beside the numbers."""

from __future__ import annotations

import pyarrow as pa
import pytest

from streamrl.trainer.batch import BATCH_SCHEMA, Batch
from streamrl.trainer.metrics import batch_metrics
from streamrl.trainer.tracking import numbers


def sequence(group: str, version: int, sampled: int, prompt: int = 3, reward: float = 0.0,
             trajectory: str = "t", moved: tuple[int, int] | None = None, calls: tuple[str, ...] = ()) -> dict:
    """A row of ``prompt`` prompt tokens then ``sampled`` sampled ones, sampled by ``version`` (``moved``: from
    sampled token ``moved[0]`` on by version ``moved[1]``)."""
    n = prompt + sampled
    versions = [version] * n
    if moved is not None:
        versions[prompt + moved[0]:] = [moved[1]] * (sampled - moved[0])
    return {"group_id": group, "trajectory_id": trajectory, "request_ids": list(calls), "token_ids": [0] * n,
            "loss_mask": [0] * prompt + [1] * sampled, "behaviour_logprobs": [0.0] * n, "token_versions": versions,
            "advantage": 0.0, "reward": reward, "policy_version": version, "temperature": 1.0}


def test_staleness_tokens_count_sampled_tokens_by_staleness() -> None:
    """Trained into version 5 (the trainer at 5): sequences of versions 5, 4 and 2 are 0, 1 and 3 behind."""
    batch = Batch.of(pa.RecordBatch.from_pylist(
        [sequence("g1", 5, 10, reward=1.0, trajectory="a"), sequence("g1", 4, 7, trajectory="b"),
         sequence("g2", 5, 2, prompt=40, reward=1.0, trajectory="c"), sequence("g2", 2, 30, trajectory="d")],
        schema=BATCH_SCHEMA))
    m = batch_metrics(batch, 5)
    assert m["staleness_tokens"] == {"0": 12, "1": 7, "3": 30}  # prompt tokens are not sampled: not counted
    assert list(m["staleness_tokens"]) == ["0", "1", "3"]
    assert m["staleness_mean"] == pytest.approx((7 * 1 + 30 * 3) / 49) and m["staleness_max"] == 3.0  # per token
    assert m["reward_mean"] == 0.5 and m["trajectories"] == 4
    assert "staleness_tokens" not in numbers(m)  # trackers (and /metrics, the policy record) take numbers only


def test_a_moved_sequences_tokens_count_at_the_version_that_sampled_them() -> None:
    """A request the engine moved from version 2 to 5 after 10 of its 30 tokens: 10 tokens 3 behind, 20 fresh."""
    batch = Batch.of(pa.RecordBatch.from_pylist(
        [sequence("g1", 2, 30, moved=(10, 5), reward=1.0, trajectory="a"), sequence("g1", 5, 4, trajectory="b")],
        schema=BATCH_SCHEMA))
    m = batch_metrics(batch, 5)
    assert m["staleness_tokens"] == {"0": 24, "3": 10}
    assert m["staleness_mean"] == pytest.approx(30 / 34) and m["staleness_max"] == 3.0


def test_multi_call_trajectories_are_counted_merged_or_split() -> None:
    """a: two calls merged into one sequence; b: three calls in two sequences (split); c: one call; d: none
    recorded (a batch built outside the assembler)."""
    batch = Batch.of(pa.RecordBatch.from_pylist(
        [sequence("g1", 5, 4, trajectory="a", calls=("r1", "r2")),
         sequence("g1", 5, 4, trajectory="b", calls=("r3",)), sequence("g1", 5, 4, trajectory="b", calls=("r4", "r5")),
         sequence("g2", 5, 4, trajectory="c", calls=("r6",)), sequence("g2", 5, 4, trajectory="d")],
        schema=BATCH_SCHEMA))
    m = batch_metrics(batch, 5)
    assert (m["trajectories_multi_call"], m["trajectories_split"]) == (2, 1)
