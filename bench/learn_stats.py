"""The learning benchmark's statistics (``bench/learn_bench.py``), pure so that they are tested without servers.

A run is one mode with one seed. Its score curve is ``[(t, version, score), ...]``, ``t`` in seconds since the
demo's start: the held-out evaluations where the task has a held-out set, else the reward each version served.

* **Level crossing**: the first point at or above the level, its ``t``. A run that never gets there is
  *censored*: counted as not reached, and taken as +inf in medians and ratios (so a median that is +inf means
  that half the runs or more did not get there in their time).
* **Speedup** of a mode over the baseline (sync), paired by seed: the baseline's time to a level over the mode's
  (2.0: twice as soon). Baseline not reached, mode reached: +inf; the other way round: 0; neither: the seed is left
  out of that level's ratio (counted as ``neither_reached``).
* **Intervals**: a percentile bootstrap of the median over seeds (seeds resampled with replacement), with a fixed
  seed, so that the same runs always give the same figures.
* **Score at a time**: the last point at or before it; none when the run had none yet or had ended.

Single runs disagree by seed (a pipeline/sync ratio of 2.08x, 1.03x and "sync never got there" over three seeds
of one setting), which is why a claim needs the median over seeds and its interval.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

Curve = Sequence[Sequence[float]]
"""``[(t, version, score), ...]`` in time order."""

INTERVAL = 0.9
RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
CENSORING_NOTE = ("a run that never reached a level counts as not reached and as +inf in medians and speedups "
                  "(a median of +inf: half the runs or more did not reach it); a seed where neither mode reached a "
                  "level is left out of that level's speedup")


def first_crossing(curve: Curve, level: float) -> float | None:
    """Seconds at which the curve first reached ``level`` (at or above it), None if it never did."""
    return next((float(t) for t, _, score in curve if _finite(score) and score >= level - 1e-9), None)


def score_at(curve: Curve, t: float, end_s: float | None = None) -> float | None:
    """The last score at or before ``t``; None before the first point, or past ``end_s`` (the run had ended)."""
    if end_s is not None and t > end_s + 1e-9:
        return None
    last = None
    for when, _, score in curve:
        if when > t + 1e-9:
            break
        if _finite(score):
            last = float(score)
    return last


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


def median(values: Sequence[float]) -> float:
    """The median, +inf values included (a middle pair with +inf in it gives +inf); NaN for no values."""
    return statistics.median(values) if values else math.nan


def nearest_rank(values: Iterable[float], q: float) -> float | None:
    """The ``q`` quantile by nearest rank (a value that occurred); None for no values."""
    ranked = sorted(values)
    return ranked[max(0, math.ceil(q * len(ranked)) - 1)] if ranked else None


def weighted_quantile(pairs: Iterable[tuple[float, float]], q: float) -> float | None:
    """The ``q`` quantile of values each counted ``weight`` times (value, weight); None when the weights sum to 0."""
    ranked = sorted((v, w) for v, w in pairs if w > 0)
    total = sum(w for _, w in ranked)
    if total <= 0:
        return None
    running = 0.0
    for value, weight in ranked:
        running += weight
        if running >= q * total - 1e-9:
            return value
    return ranked[-1][0]


def bootstrap_median_interval(values: Sequence[float], level: float = INTERVAL, resamples: int = RESAMPLES,
                              seed: int = BOOTSTRAP_SEED) -> tuple[float, float] | None:
    """A percentile-bootstrap ``level`` interval of the median (seeded); None for no values."""
    if not values:
        return None
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    tail = (1 - level) / 2
    return medians[int(tail * resamples)], medians[min(resamples - 1, int((1 - tail) * resamples))]


def speedups(baseline: dict[int, float | None], mode: dict[int, float | None]) -> tuple[dict[int, float], int]:
    """Per seed in both: the baseline's time over the mode's (None = not reached = +inf), and how many seeds
    had neither reach (left out)."""
    ratios, neither = {}, 0
    for seed in sorted(set(baseline) & set(mode)):
        b, m = baseline[seed], mode[seed]
        if b is None and m is None:
            neither += 1
        elif b is None:
            ratios[seed] = math.inf
        elif m is None:
            ratios[seed] = 0.0
        else:
            ratios[seed] = b / m if m > 0 else math.inf
    return ratios, neither


def spread(per_seed: dict[int, float], **bootstrap: Any) -> dict[str, Any]:
    """Median over seeds with its bootstrap interval, and the values per seed."""
    values = [per_seed[s] for s in sorted(per_seed)]
    return {"median": median(values) if values else None, "interval_90": bootstrap_median_interval(values, **bootstrap),
            "n": len(values), "per_seed": {str(s): v for s, v in sorted(per_seed.items())}}


def staleness_per_token(history: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Staleness (versions between the policy that sampled a token and the one trained on it) per sampled token,
    from the trainer's history. Exact where every step has its ``staleness_tokens`` histogram (sampled tokens by
    staleness): mean, p90 (nearest rank) and max over all the run's tokens. Older histories have only each step's
    mean: that mean weighted by the step's sampled tokens (a step's tokens all at its mean), max over steps.
    ``shares`` (exact only): the share of the tokens at staleness 0, 1 and 2 or more (docs/benchmarks.md, "What
    bounds staleness per sampled token")."""
    steps = [h for h in history if "staleness_mean" in h]
    if steps and all(isinstance(h.get("staleness_tokens"), dict) for h in steps):
        counts: dict[float, float] = {}
        for h in steps:
            for lag, n in h["staleness_tokens"].items():
                counts[float(lag)] = counts.get(float(lag), 0.0) + float(n)
        pairs = [(lag, n) for lag, n in counts.items() if n > 0]
        total = sum(n for _, n in pairs)
        shares = {label: sum(n for v, n in pairs if low <= v < high) / total
                  for label, low, high in (("0", 0, 1), ("1", 1, 2), ("2+", 2, math.inf))} if total else None
        return {"source": "trainer history, per token",
                "mean": sum(v * n for v, n in pairs) / total if total else None,
                "p90": weighted_quantile(pairs, 0.9), "max": max((v for v, _ in pairs), default=None),
                "shares": shares}
    pairs = [(float(h["staleness_mean"]), float(h.get("sampled_tokens") or 0)) for h in steps]
    total = sum(w for _, w in pairs)
    return {"source": "trainer history, step means weighted by tokens",
            "mean": sum(v * w for v, w in pairs) / total if total else None,
            "p90": weighted_quantile(pairs, 0.9),
            "max": max((float(h["staleness_max"]) for h in history if "staleness_max" in h), default=None)}


STEP_SECONDS = ("wait_s", "step_s", "adapter_s", "checkpoint_s", "announce_s")
"""Where a trainer step's seconds go, in its history: waiting for groups, the optimizer step, saving the adapter,
the checkpoint, the announcement."""


def trainer_waiting(history: Sequence[dict[str, Any]]) -> float | None:
    """The share of the trainer's time spent waiting for groups (each step's ``wait_s`` against its other
    seconds: the step, the adapter's save, the checkpoint, the announcement), after the first step (whose wait
    includes the run's start-up). Near 0: generation keeps up with training; near 1: the trainer mostly waits."""
    steps = [h for h in history[1:] if "wait_s" in h]
    total = sum(float(h.get(k, 0.0)) for h in steps for k in STEP_SECONDS)
    return sum(float(h["wait_s"]) for h in steps) / total if total > 0 else None


def merging(history: Sequence[dict[str, Any]]) -> dict[str, int] | None:
    """The run's trajectories of more than one call, merged into one training sequence or split into several
    (the trainer's ``trajectories_multi_call`` and ``trajectories_split`` per step); None for histories without
    them."""
    steps = [h for h in history if "trajectories_multi_call" in h]
    if not steps:
        return None
    multi = sum(int(h["trajectories_multi_call"]) for h in steps)
    split = sum(int(h.get("trajectories_split", 0)) for h in steps)
    return {"multi_call": multi, "merged": multi - split, "split": split}


def reply_tokens(history: Sequence[dict[str, Any]], demo: dict[str, Any]) -> dict[str, Any]:
    """Reply length in tokens: the demo summary's own figures where it has them (``reply_tokens``: p50, p90,
    max and n over every trajectory's sampled tokens, exact), else from the trainer's history, each step's sampled tokens per sequence (a step's mean
    reply, so p50 / p90 / max are over steps and the max understates the longest reply)."""
    own = demo.get("reply_tokens")
    if isinstance(own, dict) and {"p50", "p90", "max"} <= own.keys():
        return {"source": "demo summary, per reply", **{k: own[k] for k in ("p50", "p90", "max", "n") if k in own}}
    means = [h["sampled_tokens"] / h["sequences"] for h in history if h.get("sequences")]
    return {"source": "trainer history, mean per step", "p50": nearest_rank(means, 0.5),
            "p90": nearest_rank(means, 0.9), "max": max(means, default=None)}


def served_reward_curve(versions: dict[str, dict[str, Any]], min_trajectories: int) -> list[tuple[float, int, float]]:
    """The demo summary's reward per served version as a curve: each version with at least ``min_trajectories``
    (one group), at the time its last trajectory finished (when its mean was known)."""
    points = [(float(v["last_s"]), int(k), float(v["mean"])) for k, v in versions.items()
              if int(k) >= 0 and v.get("n", 0) >= min_trajectories and _finite(v.get("mean"))]
    return sorted(points)


def _counted(run: dict[str, Any]) -> bool:
    """Runs that count: complete (not cut short by the time budget, not failed before the demo ran)."""
    return bool(run.get("complete"))


def compute(runs: Sequence[dict[str, Any]], levels: Sequence[float], times_s: Sequence[float],
            baseline: str = "sync", resamples: int = RESAMPLES, seed: int = BOOTSTRAP_SEED) -> dict[str, Any]:
    """Every figure over seeds, per mode: time to each level, speedup over ``baseline`` (paired by seed), score and
    gain over the first score at each time, versions/s, staleness, reply length, engine idle, publish -> served,
    failures. ``runs`` are the harness's run records (``mode``, ``seed``, ``curve``, ``end_s``, ...)."""
    boot = {"resamples": resamples, "seed": seed}
    counted = [r for r in runs if _counted(r)]
    modes = list(dict.fromkeys(r["mode"] for r in counted))
    by_mode = {m: {r["seed"]: r for r in counted if r["mode"] == m} for m in modes}
    sources = sorted({r.get("score_source", "?") for r in counted})
    stats: dict[str, Any] = {"score": sources[0] if len(sources) == 1 else sources, "baseline": baseline,
                             "interval": INTERVAL, "bootstrap": boot, "censoring": CENSORING_NOTE,
                             "seeds": {m: sorted(by_mode[m]) for m in modes},
                             "left_out": [{"mode": r["mode"], "seed": r["seed"], "why": r.get("why", "incomplete")}
                                          for r in runs if not _counted(r)]}
    level_rows = []
    for level in levels:
        times = {m: {s: first_crossing(r["curve"], level) for s, r in by_mode[m].items()} for m in modes}
        row: dict[str, Any] = {"level": level, "modes": {}, "speedup": {}}
        for m in modes:
            as_inf = {s: math.inf if t is None else t for s, t in times[m].items()}
            row["modes"][m] = {**spread(as_inf, **boot), "reached": sum(t is not None for t in times[m].values()),
                               "not_reached": sum(t is None for t in times[m].values())}
        if baseline in modes:
            for m in modes:
                if m == baseline:
                    continue
                ratios, neither = speedups(times[baseline], times[m])
                row["speedup"][f"{m}/{baseline}"] = {**spread(ratios, **boot), "neither_reached": neither}
        level_rows.append(row)
    stats["levels"] = level_rows
    time_rows = []
    for t in times_s:
        row = {"t_s": t, "score": {}, "gain": {}, "success": {}, "success_gain": {}}
        for m in modes:
            for key, gain_key, curve in (("score", "gain", "curve"), ("success", "success_gain", "success_curve")):
                # every run has a score curve (empty: missing); the success curve, runs scored on a held-out set
                runs_with = {s: r for s, r in by_mode[m].items() if curve == "curve" or r.get(curve)}
                values = {s: score_at(r.get(curve) or [], t, r.get("end_s")) for s, r in runs_with.items()}
                gains = {s: v - float(runs_with[s][curve][0][2]) for s, v in values.items() if v is not None}
                row[key][m] = {**spread({s: v for s, v in values.items() if v is not None}, **boot),
                               "missing": sum(v is None for v in values.values())}
                row[gain_key][m] = spread(gains, **boot)
        time_rows.append(row)
    stats["at_times"] = time_rows
    stats["modes"] = {m: mode_figures(list(by_mode[m].values()), boot) for m in modes}
    return stats


def mode_figures(runs: Sequence[dict[str, Any]], boot: dict[str, Any]) -> dict[str, Any]:
    """One mode's steady-state figures over its seeds."""
    def per_seed(key: str, sub: str | None = None) -> dict[int, float]:
        out = {}
        for r in runs:
            value = r.get(key)
            value = value.get(sub) if sub and isinstance(value, dict) else value
            if _finite(value):
                out[r["seed"]] = float(value)
        return out

    served_ms = [ms for r in runs for ms in (r.get("publish_to_served") or {}).get("ms", [])]
    stale_max, reply_max = per_seed("staleness", "max"), per_seed("reply_tokens", "max")
    return {
        "versions_per_s": spread(per_seed("versions_per_s"), **boot),
        "staleness_per_token": {"mean": spread(per_seed("staleness", "mean"), **boot),
                                "p90": spread(per_seed("staleness", "p90"), **boot),
                                "max": max(stale_max.values(), default=None),
                                "source": sorted({(r.get("staleness") or {}).get("source", "?") for r in runs})},
        "reply_tokens": {"p50": spread(per_seed("reply_tokens", "p50"), **boot),
                         "p90": spread(per_seed("reply_tokens", "p90"), **boot),
                         "max": max(reply_max.values(), default=None),
                         "source": sorted({(r.get("reply_tokens") or {}).get("source", "?") for r in runs})},
        "engine_idle_s": spread(per_seed("engine_idle_s"), **boot),
        "engine_idle_frac": spread(per_seed("engine_idle_frac"), **boot),
        "engine_lora_slot_wait_s": {"total": round(sum(per_seed("engine_lora_slot_wait_s").values()), 2),
                                    "runs": len(per_seed("engine_lora_slot_wait_s"))},
        "publish_to_served_ms": {"versions": len(served_ms), "p50": nearest_rank(served_ms, 0.5),
                                 "p99": nearest_rank(served_ms, 0.99), "max": max(served_ms, default=None),
                                 "over_500": sum(ms > 500 for ms in served_ms)},
        "failed_requests": {"total": int(sum(per_seed("requests_failed").values())),
                            "per_seed": {str(s): int(v) for s, v in sorted(per_seed("requests_failed").items())}},
        "failed_trajectories": {"total": int(sum(per_seed("trajectories_failed").values())),
                                "per_seed": {str(s): int(v) for s, v in sorted(per_seed("trajectories_failed").items())}},
    }


class MergeError(ValueError):
    """Result files that cannot be pooled: other presets, or the same mode and seed twice."""


def merge(results: Sequence[dict[str, Any]], names: Sequence[str] | None = None, *,
          allow_other_presets: bool = False, defaults: Mapping[str, Any] | None = None,
          baseline: str | None = None, resamples: int = RESAMPLES) -> dict[str, Any]:
    """Several result files as one: their runs pooled (each keeps the file it came from and its place in that
    file's order), the statistics recomputed over every seed. Refuses files of different presets (unless allowed:
    the first file's levels and times are used) and a mode and seed completed twice (which one would pair?); a run
    cut short in one file gives way to the same mode and seed completed in another. A preset field a file lacks
    reads as its value in ``defaults`` (fields added to presets after the file was written). Speedups are over
    ``baseline`` (default: the first file's), which must be a mode of the pooled runs: files of one mode each
    (in-flight runs beside earlier pipeline runs of the same seeds) are compared so."""
    if not results:
        raise MergeError("nothing to merge")
    names = list(names or [f"#{i}" for i in range(len(results))])
    first = results[0].get("preset") or {}
    by_key: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for name, result in zip(names, results, strict=True):
        if "runs" not in result or "preset" not in result:
            raise MergeError(f"{name}: not a learn_bench result (no runs / preset)")
        theirs = {**(defaults or {}), **result["preset"]}
        ours = {**(defaults or {}), **first}
        differ = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
        if differ and not allow_other_presets:
            raise MergeError(f"{name}: another preset than {names[0]} ({', '.join(differ)} differ)")
        for run in result["runs"]:
            by_key.setdefault((run["mode"], run["seed"]), []).append({**run, "source": name})
    runs = []
    for (mode, seed), candidates in by_key.items():
        complete = [r for r in candidates if _counted(r)]
        if len(complete) > 1:
            raise MergeError(f"mode {mode} seed {seed} completed in both {complete[0]['source']} and "
                             f"{complete[1]['source']}")
        runs.append(complete[0] if complete else candidates[0])
    done = {(r["mode"], r["seed"]) for r in runs if _counted(r)}
    skipped = [{**s, "source": n} for n, r in zip(names, results, strict=True) for s in r.get("skipped", [])
               if (s["mode"], s["seed"]) not in done]
    modes = list(dict.fromkeys(r["mode"] for r in runs))
    baseline = baseline or results[0].get("baseline", "sync")
    if baseline not in modes:
        raise MergeError(f"baseline {baseline} is not among the pooled modes ({', '.join(modes)})")
    return {"bench": "learn_bench", "preset": first, "baseline": baseline, "sources": names,
            "modes": modes, "seeds": sorted({r["seed"] for r in runs}),
            "runs": runs, "skipped": skipped,
            "stats": compute(runs, first["levels"], first["times_s"], baseline=baseline, resamples=resamples)}


def jsonable(obj: Any) -> Any:
    """Strict JSON: +inf as the string "inf" (a level not reached), NaN as null, tuples as lists."""
    if isinstance(obj, float):
        if math.isnan(obj):
            return None
        if math.isinf(obj):
            return "inf" if obj > 0 else "-inf"
        return obj
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    return obj


def labelled_runs(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A loop or learning bench result's runs by label: ``mode`` (the old one-run-per-mode loop_bench files) or
    ``mode s<seed>`` (learn_bench files), for the plotting scripts."""
    if "runs" in data:
        return {f"{r['mode']} s{r['seed']}": r for r in data["runs"]}
    return dict(data.get("modes", {}))
