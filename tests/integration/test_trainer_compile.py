"""The compiled trainer path (``TrainerConfig.compile``: each decoder layer and the logprob head
compiled with torch.compile) computes what the eager path computes, on the tiny model (CPU).

Skipped where inductor cannot build code on this machine (no C++ compiler or Python headers)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from peft import get_peft_model_state_dict
from torch._dynamo.utils import counters

from streamrl.trainer.batch import Batch, sequences_batch
from streamrl.trainer.config import TrainerConfig
from streamrl.trainer.learner import Learner
from streamrl.trainer.model import load_policy, packed_logprobs, trainable_parameters
from streamrl.trainer.packing import pack


@pytest.fixture(scope="module")
def inductor() -> None:
    try:
        torch.compile(lambda x: x * 2 + 1)(torch.ones(3))
    except Exception as exc:  # e.g. no C++ compiler: nothing compiled can run here
        pytest.skip(f"torch.compile (inductor) cannot build code here: {type(exc).__name__}: {exc}")


def policy(tiny_model, compile_: bool | str) -> tuple[TrainerConfig, torch.nn.Module]:
    torch.manual_seed(0)
    config = TrainerConfig.load(None, model=str(tiny_model), device="cpu", compile=compile_)
    model = load_policy(config, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-zero B, so every LoRA weight has a gradient
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return config, model


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


def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def test_config_compile_modes() -> None:
    assert TrainerConfig.load(None, compile=True).compute.compile is True
    assert TrainerConfig.load(None, compile="static").compute.compile == "static"
    with pytest.raises(ValueError, match="compile"):
        TrainerConfig.load(None, compile="max-autotune")


def test_compiled_layers_match_eager(tiny_model, inductor) -> None:
    _, eager = policy(tiny_model, False)
    config, compiled = policy(tiny_model, True)
    # compiled in place: the same parameter names, so the same adapter files
    assert list(get_peft_model_state_dict(compiled)) == list(get_peft_model_state_dict(eager))
    rng = np.random.default_rng(0)
    # two sequences packed into one row (block-diagonal mask: the daemon's micro-batches), sampled at
    # temperatures, logits recomputed in the backward pass. One graph of each kind keeps this test short
    # on two cores; the bench's path (several rows, one sequence each) is another graph.
    [mb] = pack(as_batch([seq(40, 5, 1.0, rng), seq(29, 3, -1.0, rng)]), budget=80)
    assert tuple(mb.input_ids.shape) == (1, 69)
    temps = torch.linspace(0.6, 1.4, len(mb.target_positions))
    results = []
    for model, compiled_head in ((eager, False), (compiled, True)):
        model.train()  # as the learner runs it (eval mode would be a graph of its own)
        logp = packed_logprobs(model, mb.input_ids, mb.position_ids, mb.target_positions, temperatures=temps,
                               chunk=16, recompute=True, compiled_head=compiled_head)
        (logp * torch.linspace(-1, 1, len(logp))).sum().backward()
        results.append((logp.detach(), [p.grad.clone() for p in trainable_parameters(model)]))
    (want, want_grads), (got, got_grads) = results
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert all(g.abs().sum() > 0 for g in want_grads)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)

    # the learner's step, logits kept for the backward pass; learning rate 0, so that both steps
    # compare gradients at the same weights
    learners = [Learner(model, TrainerConfig.load(None, model="x", compile=mode, recompute_logits=False, learning_rate=0.0),
                        torch.device("cpu")) for model, mode in ((eager, False), (compiled, config.compute.compile))]
    for lengths in ((30, 21, 12), (37, 18)):  # the second step: a new row length
        seqs = [seq(n, 4, adv, rng, t) for n, adv, t in zip(lengths, (1.0, -1.0, 0.5), (0.7, 1.0, 1.2), strict=False)]
        before = graphs()
        want_stats, got_stats = (learner.step(as_batch(seqs)) for learner in learners)
        assert graphs() == before  # rows, length and targets are symbolic: new lengths compile nothing new
        assert got_stats.loss == pytest.approx(want_stats.loss, rel=1e-5, abs=1e-7)
        assert got_stats.grad_norm == pytest.approx(want_stats.grad_norm, rel=1e-4)
        for g, w in zip(trainable_parameters(compiled), trainable_parameters(eager), strict=True):
            torch.testing.assert_close(g.grad, w.grad, rtol=1e-4, atol=1e-6)
