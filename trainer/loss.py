"""The GRPO loss: one function, every option documented here and unit-tested in tests/unit/test_loss.py.

Notation, per sampled token t of sequence s (prompt tokens never enter: they are masked out):

* ``A_s``      advantage of the sequence's trajectory (reward minus group mean, optionally / (std + eps));
* ``r_t``      importance ratio pi_theta(y_t) / pi_behaviour(y_t) = exp(logp_t - behaviour_logp_t), where
               the behaviour logprob is the one logged by the gateway (the distribution vLLM sampled)
               and logp_t is computed at the same sampling temperature (logits / T, see model.py);
* per-token objective ``l_t`` (to minimise):

  - ``truncated_is`` (default): ``l_t = -min(r_t, C) * A_s`` with the truncated weight held constant:
    the gradient is ``-min(r_t, C) * A_s * grad logp_t`` (truncated importance sampling; the weight never
    exceeds C, but a token whose ratio is above C still gets a gradient, unlike clipping).
  - ``ppo_clip``: ``l_t = -min(r_t * A_s, clip(r_t, 1 - eps, 1 + eps) * A_s)`` (PPO's clipped surrogate).

* diagnostic KL(behaviour || current) per token, on the behaviour's own samples: ``(r_t - 1) - log r_t``
  (k3; unbiased because E_b[r] = 1, non-negative, small variance; see ``kl_behaviour_k3``);
* optional KL penalty to the base model (adapter disabled), the non-negative "k3" estimator
  ``kl_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1``, added as ``kl_coef * kl_t``.

Normalisation (how token terms become one number; both are exact under gradient accumulation because
the denominators are those of the whole optimizer step, passed in by the caller):

* ``token``: ``sum_t l_t / N_tokens`` — every sampled token weighs the same (long answers weigh more);
* ``sequence``: ``sum_s (sum_{t in s} l_t / |s|) / N_sequences`` — every sequence weighs the same.

The SFT loss (``sft_loss``, ``streamrl sft``) is the second loss the learner takes a step with: the negative
log-likelihood ``l_t = -logp_t`` of the target tokens (the assistant's, or a logged call's completion),
normalised the same two ways. No advantage, no ratio: the targets are demonstrations, not samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


@dataclass
class LossStats:
    """Sums over the tokens of this call (divide by ``tokens`` for means); floats, detached."""

    tokens: int
    ratio_sum: float
    truncated: int
    """Tokens whose ratio exceeded C (truncated_is) or fell outside [1-eps, 1+eps] (ppo_clip)."""
    kl_ref_sum: float
    kl_behaviour_sum: float
    """Sum of k3 estimates of KL(behaviour || current) (``kl_behaviour_k3``): how far the trained
    policy is from the sampler, on the tokens the sampler drew."""


def grpo_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    sequence_index: torch.Tensor,
    *,
    mode: Literal["truncated_is", "ppo_clip"] = "truncated_is",
    is_cap: float = 2.0,
    clip_eps: float = 0.2,
    normalize: Literal["token", "sequence"] = "token",
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    total_tokens: int | None = None,
    total_sequences: int | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """GRPO loss over the sampled tokens of one micro-batch (flat 1-D tensors, one entry per token).

    ``sequence_index[t]`` numbers the sequence of token t (0..n-1 within this call); ``advantages`` is
    per token (the sequence's advantage repeated). ``total_tokens`` / ``total_sequences`` are the
    denominators of the whole optimizer step (default: this call's own counts).
    """
    logprobs = logprobs.float()
    behaviour = behaviour_logprobs.float().to(logprobs.device)
    adv = advantages.float().to(logprobs.device)
    log_ratio = logprobs - behaviour
    ratio = torch.exp(log_ratio)
    if mode == "truncated_is":
        weight = torch.clamp(ratio, max=is_cap)
        # value -min(r, C) * A; gradient min(r, C) * A * grad(logp): the weight/ratio factor is constant
        per_token = -(weight / ratio).detach() * ratio * adv
        truncated = ratio > is_cap
    elif mode == "ppo_clip":
        clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps)
        per_token = -torch.minimum(ratio * adv, clipped * adv)
        truncated = (ratio < 1.0 - clip_eps) | (ratio > 1.0 + clip_eps)
    else:
        raise ValueError(f"unknown mode {mode!r}")
    kl_ref_sum = 0.0
    if ref_logprobs is not None and kl_coef:
        d = ref_logprobs.float().to(logprobs.device) - logprobs
        kl = torch.exp(d) - d - 1.0
        per_token = per_token + kl_coef * kl
        kl_ref_sum = float(kl.detach().sum())

    n_tokens = int(logprobs.numel())
    loss = reduce_tokens(per_token, sequence_index, normalize, total_tokens, total_sequences)

    with torch.no_grad():
        stats = LossStats(
            tokens=n_tokens,
            ratio_sum=float(ratio.sum()),
            truncated=int(truncated.sum()),
            kl_ref_sum=kl_ref_sum,
            kl_behaviour_sum=float(kl_behaviour_k3(log_ratio).sum()),
        )
    return loss, stats


def reduce_tokens(per_token: torch.Tensor, sequence_index: torch.Tensor, normalize: Literal["token", "sequence"],
                  total_tokens: int | None, total_sequences: int | None) -> torch.Tensor:
    """A micro-batch's per-token losses reduced as both losses reduce them: ``token`` divides the sum by the
    step's ``total_tokens``, ``sequence`` averages within each sequence, then divides by ``total_sequences``
    (the step's totals, so that gradient accumulation equals one big batch; the micro-batch's own when None)."""
    n_tokens = int(per_token.numel())
    if normalize == "token":
        return per_token.sum() / (total_tokens or max(n_tokens, 1))
    if normalize == "sequence":
        seq = sequence_index.to(per_token.device).long()
        n_seq = int(seq.max()) + 1 if n_tokens else 0
        sums = torch.zeros(n_seq, device=per_token.device).index_add(0, seq, per_token)
        lengths = torch.zeros(n_seq, device=per_token.device).index_add(0, seq, torch.ones_like(per_token))
        return (sums / lengths.clamp(min=1)).sum() / (total_sequences or max(n_seq, 1))
    raise ValueError(f"unknown normalize {normalize!r}")


def sft_loss(
    logprobs: torch.Tensor,
    sequence_index: torch.Tensor,
    *,
    normalize: Literal["token", "sequence"] = "token",
    total_tokens: int | None = None,
    total_sequences: int | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Negative log-likelihood of the target tokens of one micro-batch (flat 1-D, one entry per target).

    ``logprobs`` holds only the masked (trained) tokens, so the gradient reaches nothing else.
    ``normalize``: ``token`` (default) divides the sum by ``total_tokens`` (the step's target count, so
    gradient accumulation over micro-batches equals one big batch: a token-mean); ``sequence`` averages
    within each sequence first, then over ``total_sequences``. The stats' ratio fields are 0 (no sampler).
    """
    nll = -logprobs.float()
    loss = reduce_tokens(nll, sequence_index, normalize, total_tokens, total_sequences)
    return loss, LossStats(tokens=int(nll.numel()), ratio_sum=0.0, truncated=0, kl_ref_sum=0.0, kl_behaviour_sum=0.0)


def kl_behaviour_k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(behaviour || current) from tokens sampled by the behaviour policy.

    With ``r = pi_theta / pi_behaviour = exp(log_ratio)``: ``(r - 1) - log r``, non-negative and unbiased
    (``E_b[r] = 1``, so its mean is ``E_b[log b - log pi]``). Its mirror ``1/r - 1 + log r`` estimates
    KL(current || behaviour) only for samples from the current policy; on behaviour samples it blows up
    as ``1/r`` wherever the current policy gives a sampled token much less probability than the sampler.
    """
    return torch.expm1(log_ratio) - log_ratio


def group_advantages(rewards: list[float], *, std_norm: bool = True, eps: float = 1e-6) -> list[float]:
    """GRPO advantages: reward minus the group mean, optionally divided by (population std + eps)."""
    t = torch.tensor(rewards, dtype=torch.float64)
    adv = t - t.mean()
    if std_norm:
        adv = adv / (t.std(unbiased=False) + eps)
    return adv.tolist()
