"""Packing, packed logprobs and one optimizer step on the tiny model (CPU)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from streamrl.trainer.batch import Batch, sequences_batch
from streamrl.trainer.config import TrainerConfig
from streamrl.trainer.learner import Learner
from streamrl.trainer.model import load_policy, packed_logprobs
from streamrl.trainer.packing import deal, pack


@dataclass
class Seq:
    """A test's sequence, before it joins a batch (``as_batch``)."""

    token_ids: np.ndarray
    loss_mask: np.ndarray
    behaviour_logprobs: np.ndarray
    advantage: float
    temperature: float = 1.0


def as_batch(seqs: list[Seq]) -> Batch:
    return Batch.of(sequences_batch([s.token_ids.astype(np.int32) for s in seqs],
                                    [s.loss_mask.astype(np.int8) for s in seqs],
                                    behaviour_logprobs=[s.behaviour_logprobs for s in seqs],
                                    advantage=[s.advantage for s in seqs], temperature=[s.temperature for s in seqs]))


def seq(n: int, n_prompt: int, adv: float, rng: np.random.Generator, temperature: float = 1.0) -> Seq:
    return Seq(rng.integers(10, 2000, n), np.arange(n) >= n_prompt, np.full(n, -7.6, np.float32), adv, temperature)


@pytest.fixture(scope="module")
def policy(tiny_model):
    torch.manual_seed(0)
    c = TrainerConfig.load(None, model=str(tiny_model), device="cpu", learning_rate=1e-2)
    model = load_policy(c, torch.device("cpu"))
    return c, model


def test_pack_fills_budget_without_padding() -> None:
    rng = np.random.default_rng(0)
    seqs = [seq(n, 2, 1.0, rng) for n in (60, 50, 40, 30, 20, 10)]
    mbs = pack(as_batch(seqs), 100)
    # first-fit decreasing: 60+40, 50+30+20, 10; one packed row each, no padding at all
    assert sorted(mb.tokens for mb in mbs) == [10, 100, 100]
    mb = next(m for m in mbs if m.n_sequences == 2)
    assert mb.position_ids[0].tolist() == list(range(60)) + list(range(40))
    assert mb.target_positions.tolist() == list(range(2, 60)) + list(range(62, 100))
    assert mb.sequence_index.tolist() == [0] * 58 + [1] * 38
    assert sum(len(deal(mbs, 2, r)) for r in range(2)) == 3
    assert len(pack(as_batch([seq(300, 2, 1.0, rng)]), 100)) == 1  # an over-long sequence gets its own micro-batch


def test_pack_stacks_rows_and_pads_at_the_end() -> None:
    rng = np.random.default_rng(0)
    seqs = [seq(50, 2, 1.0, rng), seq(30, 2, -1.0, rng)]
    [mb] = pack(as_batch(seqs), budget=100, row_tokens=50)  # one sequence per row, two rows of width 50
    assert tuple(mb.input_ids.shape) == (2, 50) and mb.real_tokens == 80
    assert mb.position_ids[1].tolist() == list(range(50))  # padding continues the positions: no packing mask
    assert mb.target_positions.tolist() == list(range(2, 50)) + list(range(52, 80))
    assert mb.advantages.tolist() == [1.0] * 48 + [-1.0] * 28


def test_packed_logprobs_equal_separate_forward(policy) -> None:
    _, model = policy
    rng = np.random.default_rng(1)
    seqs = [seq(9, 3, 1.0, rng), seq(6, 2, 1.0, rng)]
    [mb] = pack(as_batch(seqs), 100)                        # both in one row, positions restarting
    [rows] = pack(as_batch(seqs), 18, row_tokens=9)         # one per row, the second padded
    assert tuple(mb.input_ids.shape) == (1, 15) and tuple(rows.input_ids.shape) == (2, 9)
    with torch.no_grad():
        packed = packed_logprobs(model, mb.input_ids, mb.position_ids, mb.target_positions, chunk=4)
        stacked = packed_logprobs(model, rows.input_ids, rows.position_ids, rows.target_positions, chunk=4)
        expected = []
        for s in sorted(seqs, key=lambda s: -len(s.token_ids)):
            ids = torch.as_tensor(s.token_ids)[None]
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
            pos = np.flatnonzero(s.loss_mask)
            expected.append(logp[pos - 1, ids[0, pos]])
    torch.testing.assert_close(packed, torch.cat(expected), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(stacked, torch.cat(expected), rtol=1e-5, atol=1e-5)


def test_a_step_moves_logprobs_in_the_direction_of_the_advantage(policy) -> None:
    config, model = policy
    rng = np.random.default_rng(2)
    seqs = [seq(20, 10, adv, rng) for adv in (1.0, -1.0, 1.0, -1.0)]

    def total_logprob() -> np.ndarray:
        with torch.no_grad():
            out = []
            for s in seqs:
                [mb] = pack(as_batch([s]), 4096)
                out.append(packed_logprobs(model, mb.input_ids, mb.position_ids, mb.target_positions).sum().item())
            return np.array(out)

    before = total_logprob()
    stats = Learner(model, config, torch.device("cpu")).step(as_batch(seqs))
    delta = total_logprob() - before
    assert (delta[[0, 2]] > 0).all() and (delta[[1, 3]] < 0).all(), delta
    assert stats.sampled_tokens == 40 and stats.sequences == 4 and stats.grad_norm > 0


def test_packed_logprobs_at_each_sequence_sampling_temperature(policy) -> None:
    # vLLM's processed logprobs are those of softmax(logits / T): each sequence at its own T, in one row
    _, model = policy
    rng = np.random.default_rng(3)
    seqs = [seq(9, 3, 1.0, rng, temperature=0.5), seq(6, 2, 1.0, rng, temperature=1.7)]
    [mb] = pack(as_batch(seqs), 100)
    assert sorted(set(mb.temperatures.tolist())) == pytest.approx([0.5, 1.7])
    with torch.no_grad():
        got = packed_logprobs(model, mb.input_ids, mb.position_ids, mb.target_positions,
                              temperatures=mb.temperatures, chunk=4)
        expected = []
        for s in sorted(seqs, key=lambda s: -len(s.token_ids)):
            ids = torch.as_tensor(s.token_ids)[None]
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float() / s.temperature, -1)
            pos = np.flatnonzero(s.loss_mask)
            expected.append(logp[pos - 1, ids[0, pos]])
    torch.testing.assert_close(got, torch.cat(expected), rtol=1e-5, atol=1e-5)


def test_on_policy_samples_at_temperature_have_ratio_one(tiny_model) -> None:
    # behaviour logprobs computed as vLLM reports them at T = 0.5 from the very weights being trained:
    # the first step's importance ratios must all be 1 and KL(behaviour || current) 0
    torch.manual_seed(0)
    config = TrainerConfig.load(None, model=str(tiny_model), device="cpu", learning_rate=1e-3, lora_dropout=0.0)
    model = load_policy(config, torch.device("cpu"))
    model.eval()
    rng = np.random.default_rng(4)
    seqs = []
    for adv in (1.0, -1.0):
        s = seq(16, 6, adv, rng, temperature=0.5)
        ids = torch.as_tensor(s.token_ids)[None]
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float() / 0.5, -1)
        pos = np.flatnonzero(s.loss_mask)
        s.behaviour_logprobs = np.zeros(16, np.float32)
        s.behaviour_logprobs[pos] = logp[pos - 1, ids[0, pos]].numpy()
        seqs.append(s)
    stats = Learner(model, config, torch.device("cpu")).step(as_batch(seqs))
    assert stats.ratio_mean == pytest.approx(1.0, abs=1e-4)
    assert stats.kl_behaviour == pytest.approx(0.0, abs=1e-6) and stats.truncated_frac == 0.0
