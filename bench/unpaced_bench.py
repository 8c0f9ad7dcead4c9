"""Traffic that does not wait for the trainer: an unpaced producer against ``streamrl up``, today's
backlog handling against freshest-first with steps that grow with the supply, in the same run.

For each rate (groups of ``--group-size`` kept in flight, each rewarded as soon as it is done, no pacing)
and each mode, one ``streamrl up`` (no demo; the model, engine and trainer settings of the CPU demo unless
``--model``/``--trainer``) runs for ``--seconds`` while this process produces:

  wait      ``backlog = "wait"``, ``max_step_tokens = 0``: reads pause at ``max_ready_groups``, groups
            are trained oldest first, ``groups_per_step`` per step (streamrl's behaviour before #13)
  freshest  ``backlog = "freshest"`` and the default ``max_step_tokens``: beyond ``max_ready_groups`` the
            oldest groups are dropped as they arrive, a step takes the newest first, up to the budget

Reported per run: groups generated and trained (and the share, of all groups and of the groups whose
rewards were not all equal: only those carry a signal), the share of generated completion tokens trained on, staleness of trained samples (mean, max), versions published, the reward of the served
policy at the start and at the end, and the reward per 15 s against wall-clock time.

    .venv/bin/python bench/unpaced_bench.py --rates 1,2 --seconds 180 --json runs/unpaced.json     # CPU
    # one H200, the real model on arithmetic (scripts/gpu/benches.sh unpaced-real):
    python3 bench/unpaced_bench.py --model /root/stash/models/smollm2-135m --task arithmetic --group-size 16 \
        --rates 8,32 --engine '{"device": "0", "gpu_memory_utilization": 0.35}' \
        --trainer '{"device": "cuda:0", "learning_rate": 5e-4, "groups_per_step": 8, "lora_rank": 16}'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from streamrl.broker.embedded import free_port
from streamrl.config_file import nest
from streamrl.producers.demo_cli import DemoConfig
from streamrl.producers.runner import RunLimits, run_groups
from streamrl.trainer.config import TrainerConfig

MODES = {"wait": {"backlog": "wait", "max_step_tokens": 0}, "freshest": {"backlog": "freshest"}}


class TimedTask:
    """The task, with the time, reward and serving version of every finished trajectory written down."""

    def __init__(self, task) -> None:
        self.task, self.samples, self.t0 = task, [], time.monotonic()

    def sample(self, rng: random.Random):
        return self.task.sample(rng)

    async def episode(self, gateway, problem, group_id: str, group_size: int):
        outcome = await self.task.episode(gateway, problem, group_id, group_size)
        self.samples.append((time.monotonic() - self.t0, outcome.reward, outcome.version))
        return outcome


def trainer_counts(metrics_port: int) -> dict[str, float]:
    """The trainer's record and group outcomes from its /metrics (kept current between steps)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "streamrl_trainer_records_total":
                counts[sample.labels["outcome"]] = sample.value
            elif sample.name in ("streamrl_trainer_generated_tokens_total", "streamrl_trainer_trained_tokens_total"):
                counts["tokens_" + sample.name.split("_")[2]] = sample.value
    return counts


def run(mode: str, rate: int, args: argparse.Namespace, out: Path) -> dict:
    run_dir = out / f"{mode}-r{rate}"
    port, metrics_port = free_port(), free_port()
    trainer = nest(TrainerConfig, {"metrics_port": metrics_port, "learning_rate": 2e-2, "groups_per_step": 2,
                                   "group_size": args.group_size, "lora_rank": 8, "max_lag": 4, "group_timeout_s": 20.0,
                                   **json.loads(args.trainer), **MODES[mode]})  # flat names -> [trainer.*] tables
    config = {"up": {"port": port, "work_dir": str(run_dir), **({"model": args.model} if args.model else {})},
              "trainer": trainer, **({"engine": json.loads(args.engine)} if args.engine else {})}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(config, indent=2))
    log = open(run_dir / "up.log", "wb")  # noqa: SIM115 - the child writes it
    proc = subprocess.Popen([sys.executable, "-m", "streamrl.cli", "up", "--config", str(run_dir / "config.json")],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:  # ready: the gateway answers and the trainer serves its metrics (its model is loaded)
            assert proc.poll() is None and time.monotonic() < deadline, (run_dir / "up.log").read_text()[-2000:]
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200 and \
                        httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        task = TimedTask(DemoConfig(task=args.task, max_tokens=args.max_tokens).make_task())
        board = asyncio.run(run_groups(url, task, group_size=args.group_size, concurrency=rate,
                                       limits=RunLimits(max_seconds=args.seconds), emit=lambda _: None))
        time.sleep(args.drain_s)  # the trainer's last step on what was sent (its history is read below)
        counted = trainer_counts(metrics_port)  # what it classified after its last step too
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(120)
    history = [json.loads(x) for x in (run_dir / "history.jsonl").read_text().splitlines()] \
        if (run_dir / "history.jsonl").exists() else []
    counts = {**(history[-1]["counts"] if history else {}), **counted}
    trained = sum(h["groups"] for h in history)
    lags = [(h["staleness_mean"], h["staleness_max"], h["groups"]) for h in history]
    bins: dict[int, list[float]] = {}
    for t, reward, _ in task.samples:
        bins.setdefault(int(t // 15), []).append(reward)
    curve = [(15 * b + 7.5, sum(r) / len(r)) for b, r in sorted(bins.items())]
    first = [r for t, r, _ in task.samples if t < 30]
    last = [r for t, r, _ in task.samples if t >= args.seconds - 30]
    return {
        "mode": mode, "rate": rate, "groups_generated": board.groups, "groups_trained": trained,
        "share_trained": trained / max(board.groups, 1),
        "signal_share_trained": trained / max(board.groups - counts.get("groups_no_signal", 0), 1),
        "tokens_share_trained": counts.get("tokens_trained", 0) / max(counts.get("tokens_generated", 0), 1)
        if "tokens_generated" in counts else None,
        "staleness_mean": sum(m * g for m, _, g in lags) / max(trained, 1),
        "staleness_max": max((x for _, x, _ in lags), default=None),
        "versions": len(history), "failed": board.failed,
        "dropped": {k: counts.get(k, 0) for k in ("groups_dropped_stale", "groups_dropped_overload",
                                                  "groups_no_signal", "incomplete_dropped")},
        "reward_first_30s": sum(first) / max(len(first), 1), "reward_last_30s": sum(last) / max(len(last), 1),
        "reward_curve": curve,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="1,2", help="groups kept in flight, one run per rate and mode")
    p.add_argument("--modes", default="wait,freshest")
    p.add_argument("--seconds", type=float, default=180)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--model", help="base model (default: the CPU demo's tiny model)")
    p.add_argument("--task", default="numbers", help="the producer's task: numbers or arithmetic")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--engine", default="", help="JSON of the [engine] table, e.g. its GPU and memory share")
    p.add_argument("--trainer", default="{}", help="JSON of further trainer settings by flag name (lora_rank), e.g. for a GPU")
    p.add_argument("--drain-s", type=float, default=5.0)
    p.add_argument("--out", default="runs/unpaced-bench")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    out = Path(args.out)
    results = []
    for rate in [int(x) for x in args.rates.split(",")]:
        for mode in args.modes.split(","):
            r = run(mode, rate, args, out)
            results.append(r)
            print(f"[{mode} r{rate}] " + json.dumps({k: v for k, v in r.items() if k != "reward_curve"}), flush=True)
            if args.json:
                args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "runs": results},
                                                indent=2))
    print("\n| groups in flight | mode | generated | trained | share (of groups with a signal) | tokens trained "
          "| staleness mean / max | versions | reward first 30 s -> last 30 s |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | --- | ---: | --- |")
    for r in results:
        tok = "-" if r["tokens_share_trained"] is None else f"{r['tokens_share_trained']:.0%}"
        print(f"| {r['rate']} | {r['mode']} | {r['groups_generated']} | {r['groups_trained']} | {r['share_trained']:.0%} "
              f"({r['signal_share_trained']:.0%}) "
              f"| {tok} | {r['staleness_mean']:.2f} / {r['staleness_max']} | {r['versions']} "
              f"| {r['reward_first_30s']:.3f} -> {r['reward_last_30s']:.3f} |")


if __name__ == "__main__":
    main()
