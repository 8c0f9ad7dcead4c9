"""The GRPO loss and advantages against values computed by hand (see trainer/loss.py for the formulas).

Fixture: three sampled tokens, the first two in sequence 0, the third in sequence 1, with importance
ratios r = [3, 0.5, 1] (log-ratios ln 3, ln 0.5, 0) and advantages A = [1, -2, 2].
"""

from __future__ import annotations

import math

import pytest
import torch

from streamrl.trainer.loss import group_advantages, grpo_loss

BEHAVIOUR = torch.tensor([-1.0, -2.0, -0.5])
LOG_RATIO = torch.tensor([math.log(3.0), math.log(0.5), 0.0])
ADV = torch.tensor([1.0, -2.0, 2.0])
SEQ = torch.tensor([0, 0, 1])


def run(**kw):
    logp = (BEHAVIOUR + LOG_RATIO).clone().requires_grad_(True)
    loss, stats = grpo_loss(logp, BEHAVIOUR, ADV, SEQ, **kw)
    loss.backward()
    return loss.item(), logp.grad.tolist(), stats


def test_truncated_is_per_token() -> None:
    # l_t = -min(r, 2) * A = [-2, 1, -2]; mean over 3 tokens = -1
    loss, grad, stats = run(mode="truncated_is", is_cap=2.0, normalize="token")
    assert loss == pytest.approx(-1.0)
    # d/dlogp = -min(r, C) * A / 3: the truncated token keeps a gradient (weight 2), unlike clipping
    assert grad == pytest.approx([-2 / 3, 1 / 3, -2 / 3])
    assert stats.tokens == 3 and stats.truncated == 1
    assert stats.ratio_sum == pytest.approx(4.5)


def test_truncated_is_per_sequence() -> None:
    # sequence means: (-2 + 1) / 2 = -0.5 and -2; mean over 2 sequences = -1.25
    loss, grad, _ = run(mode="truncated_is", is_cap=2.0, normalize="sequence")
    assert loss == pytest.approx(-1.25)
    assert grad == pytest.approx([-2 / 4, 1 / 4, -2 / 2])


def test_step_denominators_are_used_for_accumulation() -> None:
    # the same micro-batch inside a step of 6 tokens / 4 sequences weighs half as much
    assert run(normalize="token", total_tokens=6)[0] == pytest.approx(-0.5)
    assert run(normalize="sequence", total_sequences=4)[0] == pytest.approx(-0.625)


def test_ppo_clip() -> None:
    # min(rA, clip(r, .8, 1.2) A): [min(3, 1.2), min(-1, -1.6), min(2, 2)] = [1.2, -1.6, 2] -> l = [-1.2, 1.6, -2]
    loss, grad, stats = run(mode="ppo_clip", clip_eps=0.2, normalize="token")
    assert loss == pytest.approx(-1.6 / 3)
    # clipped tokens get no gradient; the last: d(-r A)/dlogp = -r A / 3 = -2/3
    assert grad == pytest.approx([0.0, 0.0, -2 / 3])
    assert stats.truncated == 2


def test_kl_penalty_to_reference() -> None:
    # ref - logp = [0, ln 2, -ln 2] -> k3 = e^d - d - 1 = [0, 1 - ln 2, ln 2 - 0.5], sum 0.5
    logp = BEHAVIOUR + LOG_RATIO
    ref = logp + torch.tensor([0.0, math.log(2.0), -math.log(2.0)])
    base, _, _ = run(normalize="token")
    loss, _, stats = run(normalize="token", ref_logprobs=ref, kl_coef=0.1)
    assert stats.kl_ref_sum == pytest.approx(0.5)
    assert loss == pytest.approx(base + 0.1 * 0.5 / 3)


def test_kl_to_behaviour_statistic() -> None:
    # k3 of KL(behaviour || current) on behaviour samples: (r - 1) - ln r = [2 - ln 3, -0.5 + ln 2, 0]
    _, _, stats = run()
    assert stats.kl_behaviour_sum == pytest.approx(2 - math.log(3) - 0.5 + math.log(2))


def test_kl_to_behaviour_stays_bounded_where_the_current_policy_is_much_less_likely() -> None:
    # the sampler gave the token probability e^-1, the current policy e^-15: r = e^-14, so
    # (r - 1) - ln r = e^-14 - 1 + 14 (about 13); the mirrored estimator 1/r - 1 + ln r is about 1.2e6
    logp = torch.tensor([-15.0])
    _, stats = grpo_loss(logp, torch.tensor([-1.0]), torch.tensor([1.0]), torch.tensor([0]))
    assert stats.kl_behaviour_sum == pytest.approx(math.exp(-14.0) - 1.0 + 14.0)


def test_kl_to_behaviour_estimates_the_true_kl_on_behaviour_samples() -> None:
    # tokens drawn from b: the mean of the k3 terms converges to KL(b || pi) = sum_y b(y) ln(b(y) / pi(y))
    b, pi = torch.tensor([0.7, 0.2, 0.1]), torch.tensor([0.2, 0.3, 0.5])
    exact = float((b * (b / pi).log()).sum())  # 0.6349...
    y = torch.multinomial(b, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    n = len(y)
    _, stats = grpo_loss(pi.log()[y], b.log()[y], torch.zeros(n), torch.zeros(n, dtype=torch.long))
    assert stats.kl_behaviour_sum / n == pytest.approx(exact, rel=0.01)
    assert exact == pytest.approx(0.6349, abs=1e-3)


def test_group_advantages() -> None:
    assert group_advantages([1.0, 0.0, 0.0, 1.0], std_norm=False) == pytest.approx([0.5, -0.5, -0.5, 0.5])
    # population std 0.5 -> (r - 0.5) / (0.5 + eps)
    assert group_advantages([1.0, 0.0, 0.0, 1.0]) == pytest.approx([1.0, -1.0, -1.0, 1.0], rel=1e-5)
    assert group_advantages([2.0, 2.0]) == [0.0, 0.0]
