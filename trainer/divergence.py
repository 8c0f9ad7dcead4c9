"""Is the trainer diverging? Each step's off-policy statistics judged against thresholds.

A learning rate too high for the model shows first in how far the weights being trained have moved from
the ones that sampled the step's tokens: KL(behaviour || current) per sampled token grows, the mean
importance ratio r = pi/b of the sampled tokens falls below 1 (tokens the sampler liked became unlikely),
and more tokens have their ratio truncated (or clipped). A healthy run has single noisy steps too (the
tiny demo's KL reached 3.54 on one step, with 2.1 on the next), so the thresholds apply to the means over
a short window of steps, ``window`` (2): over two steps the healthy demo runs stayed below a mean KL of
3.0 and the diverged ones reached 3.6-5.6 at once (docs/trainer.md, "Divergence", has the measurements).

A step whose samples all came from the weights being trained (staleness 0) cannot show how big the updates
are (its KL is ~0 at any learning rate), so it does not enter the window (in a measured run at a learning
rate 50x too high, the two diverged steps came on either side of one); judged alone, its statistics can
only show that the sampler's logprobs and the trainer's disagree for the same weights. Non-finite
statistics (NaN weights or gradients) diverge at once.

The likely cause is named from the staleness: the KL of samples ``s`` versions behind spans ``s`` updates,
so clearly stale samples (more than ``STALE_VERSIONS`` behind on average) point at ``max_lag`` and
``backlog``; otherwise the updates themselves are too big (``learning_rate``).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

EXIT_DIVERGED = 3
"""The trainer's exit code when ``stop_on_divergence`` stopped it (2 is a usage error)."""

STALE_VERSIONS = 2.0
"""Mean staleness (versions behind) above which stale samples, not the learning rate, are the likely cause:
a pipelined loop trains on samples about one version behind (the measured demo runs: mostly 1.0, at most 2.0)."""

JUDGED = ("kl_behaviour", "ratio_mean", "truncated_frac")
"""The statistics averaged over the window and compared with the thresholds."""

WORST = (max, min, max)
"""Each judged statistic's worst single step (a high KL, a low ratio, a high clipped share). In a window of 3 or
more steps it is left out of the mean: one swinging step then counts for no more than in a window of 2 (a healthy
demo run's fourth step reached a KL of 7.8 between steps of 1.3-3.0, a 4-step mean of 3.57), while a run that
stays off crosses on the others."""


def window_mean(values: Sequence[float], worst: Callable[[Sequence[float]], float]) -> float:
    """The mean of a window's values, its worst one left out when there are 3 or more (``WORST``)."""
    kept = list(values)
    if len(kept) >= 3:
        kept.remove(worst(kept))
    return sum(kept) / len(kept)

FINITE = (*JUDGED, "loss", "grad_norm")
"""A step's statistics that must be finite: a NaN or infinity in any diverges at once, whatever the window
(the weights or their gradients have blown up; no later step recovers them)."""

Cause = Literal["learning_rate", "staleness", "mismatch"]


@dataclass(frozen=True)
class DivergenceThresholds:
    """What counts as diverging: any one threshold crossed by the means over the last ``window`` steps.
    A threshold of 0 turns its check off. ``TrainerConfig.divergence`` (``[trainer.divergence]``, flags
    ``--divergence-kl`` and so on); docs/trainer.md, "Divergence", has the runs behind the defaults."""

    kl: float = 3.5
    """Diverging when KL(behaviour || current), nats per sampled token, averaged over ``window`` steps exceeds
    this (healthy demo runs: at most 3.0; runs at a learning rate 10-50x too high: 3.6-5.6; 0: no KL check)."""
    ratio_low: float = 0.5
    """Diverging when the mean importance ratio of the sampled tokens, averaged over ``window`` steps, falls
    below this (healthy: 0.78 or more; diverged: 0.61-0.64; 0: no check)."""
    clipped: float = 0.3
    """Diverging when the share of sampled tokens whose ratio was truncated (ratio > ``is_cap``), averaged
    over ``window`` steps, exceeds this (healthy runs: at most 0.15; 0: no check). ``truncated_is`` only:
    ``ppo_clip``'s share of ratios outside 1 ± ``clip_eps`` reached 0.93 in a healthy demo run."""
    window: int = 2
    """Steps (at staleness above 0) averaged before the thresholds apply: single steps of healthy runs reached
    a KL of 3.54 and a ratio of 0.722, their 2-step means stayed within 3.0 and 0.78. 1: each step alone; 3 or
    more: each statistic's worst step is left out of its mean (``WORST``). Non-finite statistics diverge at
    once."""

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError("divergence.window must be >= 1")
        if min(self.kl, self.ratio_low, self.clipped) < 0 or self.clipped > 1:
            raise ValueError("divergence thresholds must be >= 0 (0: that check off), divergence.clipped <= 1")

    def for_mode(self, is_mode: str) -> DivergenceThresholds:
        """The thresholds that apply under the loss's ``is_mode``: ``ppo_clip``'s clipped share is no sign of
        divergence (see ``clipped``), so that check is off there."""
        return self if is_mode == "truncated_is" else dataclasses.replace(self, clipped=0.0)

    def crossed(self, kl: float, ratio: float, clipped: float) -> tuple[str, ...]:
        """Each threshold the numbers are beyond, as ``measured vs threshold`` (NaN counts as beyond)."""
        out = []
        if self.kl and not kl <= self.kl:
            out.append(f"KL(behaviour||current) {kl:.3g} > {self.kl:g} nats/token")
        if self.ratio_low and not ratio >= self.ratio_low:
            out.append(f"mean importance ratio {ratio:.3g} < {self.ratio_low:g}")
        if self.clipped and not clipped <= self.clipped:
            out.append(f"clipped share {clipped:.3g} > {self.clipped:g}")
        return tuple(out)

    def describe(self) -> str:
        """The thresholds that are on, e.g. ``thresholds on the mean of 2 steps: KL > 3.5, ratio < 0.7``."""
        on = [f"{name} {op} {value:g}" for name, op, value in
              (("KL", ">", self.kl), ("ratio", "<", self.ratio_low), ("clipped", ">", self.clipped)) if value]
        steps = ("this step" if self.window == 1 else f"the mean of {self.window} steps"
                 + (", the worst left out" if self.window >= 3 else ""))
        return f"thresholds on {steps}: {', '.join(on) or 'none'}"


@dataclass(frozen=True)
class Verdict:
    """One step judged."""

    diverging: bool
    crossed: tuple[str, ...]
    """The thresholds crossed (by the window's means, or by this step alone at staleness 0)."""
    cause: Cause | None
    """The likely cause when diverging."""
    message: str
    """When diverging, what to log: the measured values, the thresholds, the likely cause and what to do."""


class DivergenceDetector:
    """Judges each step in order; holds the statistics of the last ``window`` steps at staleness above 0."""

    def __init__(self, thresholds: DivergenceThresholds, learning_rate: float, max_lag: int,
                 backlog: str = "freshest") -> None:
        self.thresholds = thresholds
        self.learning_rate, self.max_lag, self.backlog = learning_rate, max_lag, backlog
        self.recent: deque[tuple[float, ...]] = deque(maxlen=thresholds.window)

    def judge(self, step: Mapping[str, float]) -> Verdict:
        """``step``: the step's ``kl_behaviour``, ``ratio_mean``, ``truncated_frac``, ``staleness_mean`` and
        ``staleness_max`` (the keys of a history line), ``loss`` and ``grad_norm`` where known."""
        t = self.thresholds
        broken = [k for k in FINITE if k in step and not math.isfinite(step[k])]
        values = tuple(step[k] for k in JUDGED)
        fresh = step["staleness_max"] == 0
        if fresh:  # judged alone: its KL says nothing of the updates, only of sampler and trainer agreeing
            crossed, over = t.crossed(*values), "this step (staleness 0)"
        else:
            self.recent.append(values)
            if len(self.recent) < t.window and not broken:
                return Verdict(False, (), None, "")
            means = [window_mean(column, worst) for column, worst in zip(zip(*self.recent, strict=True), WORST,
                                                                          strict=True)]
            crossed = t.crossed(*means)
            over = "this step" if len(self.recent) == 1 else f"the last {len(self.recent)} steps"
        if broken:
            crossed += (f"non-finite {', '.join(broken)}",)
        if not crossed:
            return Verdict(False, (), None, "")
        cause: Cause = ("learning_rate" if broken else "mismatch" if fresh
                        else "staleness" if step["staleness_mean"] > STALE_VERSIONS else "learning_rate")
        message = (f"over {over}: {'; '.join(crossed)} (this step: KL {step['kl_behaviour']:.3g} nats/token, "
                   f"mean ratio {step['ratio_mean']:.3g}, clipped {step['truncated_frac']:.3g}, staleness "
                   f"{step['staleness_mean']:.1f} mean / {step['staleness_max']:.0f} max of max_lag "
                   f"{self.max_lag}; {t.describe()}); {self._advice(cause, step['staleness_mean'], bool(broken))}")
        return Verdict(True, crossed, cause, message)

    def _advice(self, cause: Cause, staleness: float, broken: bool) -> str:
        lr = self.learning_rate
        if cause == "learning_rate":
            why = ("the weights or their gradients blew up" if broken else
                   f"the samples are only {staleness:.1f} versions behind, so the updates themselves moved the "
                   "policy this far")
            return (f"likely cause: learning_rate = {lr:g} is too high for this model ({why}): lower it, e.g. to "
                    f"{lr / 10:g}")
        if cause == "staleness":
            fresher = " or backlog = 'freshest' (the newest groups first)" if self.backlog == "wait" else ""
            return (f"likely cause: stale samples ({staleness:.1f} versions behind on average, max_lag "
                    f"{self.max_lag}, backlog = {self.backlog!r}): lower max_lag{fresher}; or lower "
                    f"learning_rate = {lr:g}")
        return ("likely cause: these samples came from the very weights being trained (staleness 0), so the "
                "sampler's logprobs and the trainer's disagree: check the sampling temperature and top-p/top-k, "
                f"and that the served adapter is the trained one (learning_rate = {lr:g})")
