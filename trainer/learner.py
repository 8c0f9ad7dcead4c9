"""One optimizer step over a set of groups: pack, accumulate gradients, all-reduce, clip, step.

With torch.distributed initialised (torchrun, WORLD_SIZE > 1) every rank gets the same sequences,
takes its share of micro-batches and the LoRA gradients are summed across ranks before clipping; the
loss denominators are those of the whole step, so the result equals the single-process step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import pyarrow as pa
import torch
import torch.distributed as dist

from .batch import Batch
from .config import TrainerConfig
from .loss import grpo_loss, sft_loss
from .model import packed_logprobs, packed_predictions, trainable_parameters
from .packing import deal, pack

TOTALS = ("loss", "sampled_tokens", "ratio_sum", "truncated", "kl_behaviour_sum", "kl_ref_sum", "tokens")
"""What each micro-batch adds to its step's totals, in the order of the one tensor summed across ranks."""


@dataclass
class StepStats:
    loss: float
    tokens: int
    """All tokens (prompt and sampled, padding excluded) run through the model, all ranks together."""
    sampled_tokens: int
    sequences: int
    micro_batches: int
    ratio_mean: float
    truncated_frac: float
    kl_behaviour: float
    kl_ref: float
    grad_norm: float
    seconds: float


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


class Learner:
    def __init__(self, model: torch.nn.Module, config: TrainerConfig, device: torch.device) -> None:
        self.model = model
        self.config = config
        self.device = device
        self.params = trainable_parameters(model)
        self.optimizer = torch.optim.AdamW(self.params, lr=config.optim.learning_rate, betas=config.optim.adam_betas,
                                           weight_decay=config.optim.weight_decay)

    def step(self, batch: Batch | pa.RecordBatch, loss: Literal["grpo", "sft"] = "grpo") -> StepStats:
        """One optimizer step over a step's batch (``BATCH_SCHEMA``). ``loss="sft"`` (``streamrl sft``): the same packing, accumulation and optimizer
        with the NLL of the masked tokens (``sft_loss``) instead of GRPO's; no sampler, so the ratio and KL
        statistics stay 0 and ``kl_coef`` does not apply."""
        if loss not in ("grpo", "sft"):
            raise ValueError(f"unknown loss {loss!r}")
        c = self.config
        start = time.perf_counter()
        world, rank = _world()
        batch = batch if isinstance(batch, Batch) else Batch.of(batch)
        total_tokens, n_sequences = batch.sampled_tokens(), batch.rows
        mine = deal(pack(batch, c.compute.micro_batch_tokens, c.compute.row_tokens), world, rank)
        self.model.train()
        for p in self.params:  # zeros, not None: a rank without micro-batches still joins the all-reduce
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad.zero_()
        sums = torch.zeros(len(TOTALS), dtype=torch.float64)
        for mb in mine:
            scaled = bool((mb.temperatures != 1.0).any())  # all at temperature 1: no extra logits pass
            mb = mb.to(self.device)
            temps = mb.temperatures if scaled else None
            # at each sequence's sampling temperature: the ratio compares the distributions vLLM sampled
            logp = packed_logprobs(self.model, mb.input_ids, mb.position_ids, mb.target_positions,
                                   temperatures=temps, chunk=c.compute.logit_chunk_tokens,
                                   recompute=c.compute.recompute_logits, compiled_head=bool(c.compute.compile))
            if loss == "sft":
                value, st = sft_loss(logp, mb.sequence_index, normalize=c.loss.normalize, total_tokens=total_tokens,
                                     total_sequences=n_sequences)
                value.backward()
                sums += torch.tensor([value.item(), st.tokens, 0, 0, 0, 0, mb.real_tokens], dtype=torch.float64)
                continue
            ref = None
            if c.loss.kl_coef:
                with torch.no_grad(), self.model.disable_adapter():
                    ref = packed_logprobs(self.model, mb.input_ids, mb.position_ids, mb.target_positions,
                                          temperatures=temps, chunk=c.compute.logit_chunk_tokens,
                                          compiled_head=bool(c.compute.compile))
            loss, st = grpo_loss(logp, mb.behaviour_logprobs, mb.advantages, mb.sequence_index, mode=c.loss.is_mode,
                                 is_cap=c.loss.is_cap, clip_eps=c.loss.clip_eps, normalize=c.loss.normalize, ref_logprobs=ref,
                                 kl_coef=c.loss.kl_coef, total_tokens=total_tokens, total_sequences=n_sequences)
            loss.backward()
            sums += torch.tensor([loss.item(), st.tokens, st.ratio_sum, st.truncated, st.kl_behaviour_sum,
                                  st.kl_ref_sum, mb.real_tokens], dtype=torch.float64)
        if world > 1:  # one flat all-reduce of every LoRA gradient, and the sums on the device (NCCL)
            grads = [p.grad for p in self.params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                g.copy_(part.view_as(g))
            sums = sums.to(self.device)
            dist.all_reduce(sums)
            sums = sums.cpu()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, c.optim.max_grad_norm)
        self.optimizer.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t = dict(zip(TOTALS, sums.tolist(), strict=True))
        k = max(t["sampled_tokens"], 1.0)
        return StepStats(
            loss=t["loss"], tokens=int(t["tokens"]), sampled_tokens=int(t["sampled_tokens"]),
            sequences=n_sequences, micro_batches=len(mine), ratio_mean=t["ratio_sum"] / k,
            truncated_frac=t["truncated"] / k, kl_behaviour=t["kl_behaviour_sum"] / k, kl_ref=t["kl_ref_sum"] / k,
            grad_norm=float(grad_norm), seconds=time.perf_counter() - start,
        )

    @torch.no_grad()
    def evaluate(self, batch: Batch | pa.RecordBatch) -> tuple[float, float, int]:
        """Held-out (token-mean NLL, token accuracy, target tokens) of ``batch``'s sequences, packed as a step is;
        all of them in this process (SFT runs single-process)."""
        c = self.config
        was_training = self.model.training
        self.model.eval()  # no LoRA dropout while measuring
        nll, hits, n = 0.0, 0, 0
        try:
            for mb in pack(batch if isinstance(batch, Batch) else Batch.of(batch), c.compute.micro_batch_tokens, c.compute.row_tokens):
                mb = mb.to(self.device)
                logp, correct = packed_predictions(self.model, mb.input_ids, mb.position_ids, mb.target_positions,
                                                   chunk=c.compute.logit_chunk_tokens)
                nll -= float(logp.sum())
                hits += int(correct.sum())
                n += int(logp.numel())
        finally:
            self.model.train(was_training)
        return nll / max(n, 1), hits / max(n, 1), n
