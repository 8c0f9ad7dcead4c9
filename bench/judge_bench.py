"""streamrl judge's throughput and cost: judged trajectories per second and judge tokens per trajectory.

Starts the embedded broker and a ``streamrl engine`` (the tiny random model built here unless ``--model``
is given; or ``--engine-url`` for a running one), writes ``--groups`` groups of ``--group-size`` arithmetic
trajectories (a question, a tool call to a calculator, its result and a final answer, right or wrong) with a
judge request each, runs the judge service until every trajectory has its reward, and reports:

* judged trajectories/s (first judge request read to last reward acknowledged),
* judge prompt and completion tokens per trajectory, attempts per group, failures,
* ranking agreement: among pairs of a group with one right and one wrong final answer, the share the judge
  scored right above wrong (ties count half); 0.5 is chance. The tiny random model is there to measure
  throughput, not judgement.

    .venv/bin/python bench/judge_bench.py [--groups 16] [--group-size 4] [--concurrency 4] [--json FILE]
    .venv/bin/python bench/judge_bench.py --model smollm2-135m ...   # a real judge (on the GPU: docs/benchmarks.md)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from harness import stamp


def trajectories(groups: int, size: int, seed: int) -> list[tuple[str, list[dict], str, bool]]:
    """(group id, messages, final answer, right?) per trajectory: half the answers right, half off by a bit."""
    from streamrl.producers.arithmetic import make_problem

    rng = random.Random(seed)
    out = []
    for g in range(groups):
        p = make_problem(rng)
        for i in range(size):
            right = i % 2 == 0
            answer = p.answer if right else p.answer + rng.choice((-3, -1, 1, 2, 10))
            call = {"id": "c1", "type": "function", "function": {"name": "calculator",
                                                                 "arguments": json.dumps({"expression": "..."})}}
            messages = [{"role": "user", "content": f"{p.question} Answer with just the number."},
                        {"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": "c1", "name": "calculator", "content": str(answer)}]
            out.append((f"bench-g{g}", messages, f"The answer is {answer}.", right))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model path or a name `streamrl model` knows (default: the tiny model)")
    ap.add_argument("--engine-url", help="a running streamrl engine / vLLM (base URL without /v1)")
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-explanation-chars", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, help="the judge's max_tokens (default: none asked, as the service's default)")
    ap.add_argument("--engine-args", default="", help="extra vLLM arguments")
    ap.add_argument("--out", type=Path, default=Path("/tmp/judge-bench"))
    ap.add_argument("--json", type=Path, help="write the results here too")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import httpx

    from streamrl.broker.clients import make_consumer, make_producer
    from streamrl.broker.embedded import EmbeddedBroker
    from streamrl.broker.schema import CompletionRecord, JudgeRequest, RewardRecord, decode, encode
    from streamrl.broker.security import KafkaSettings
    from streamrl.broker.topics import Topics
    from streamrl.engine.server import Engine, EngineConfig
    from streamrl.judge.config import JudgeConfig
    from streamrl.judge.service import JudgeService

    args.out.mkdir(parents=True, exist_ok=True)
    engine = None
    if args.engine_url is None:
        if args.model is None:
            from streamrl.tiny_model import build_model

            model_dir = args.out / "model-tiny"
            if not (model_dir / "config.json").exists():
                build_model(model_dir, "tiny", seed=0)
            args.model = str(model_dir)
        elif not Path(args.model).exists():
            from streamrl.packaged_models import resolve

            args.model = resolve(args.model, args.out / "models", print)
        engine = Engine(EngineConfig(model=args.model, max_model_len=4096, extra_args=args.engine_args.split()),
                        log_file=args.out / "engine.log").start(timeout=900)
        args.engine_url = engine.url
    topics = Topics(f"judge-bench-{os.getpid()}")
    broker = EmbeddedBroker(topics=topics, partitions=4).start()
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()},
                               **stamp()}
    try:
        served = httpx.get(f"{args.engine_url}/v1/models").json()["data"][0]["id"]
        trajs = trajectories(args.groups, args.group_size, args.seed)
        producer = make_producer(broker.bootstrap_servers)
        right: dict[str, bool] = {}
        for n, (gid, messages, answer, ok) in enumerate(trajs):
            tid = f"bench-t{n}"
            right[tid] = ok
            rec = CompletionRecord(request_id=tid, trajectory_id=tid, group_id=gid, prompt_token_ids=np.arange(8),
                                   completion_token_ids=np.arange(4), logprobs=np.zeros(4),
                                   request={"messages": messages}, response_text=answer)
            producer.send(topics.completions, key=tid.encode(), value=encode(rec))
            producer.send(topics.rewards, key=tid.encode(),
                          value=encode(JudgeRequest(tid, group_id=gid, group_size=args.group_size,
                                                    rubric="Is the final answer arithmetically correct?")))
        producer.flush()
        producer.close()
        config = JudgeConfig(base_url=f"{args.engine_url}/v1", model=served,
                             kafka=KafkaSettings(bootstrap_servers=broker.bootstrap_servers, topic_prefix=topics.prefix),
                             concurrency=args.concurrency, name="bench",
                             max_explanation_chars=args.max_explanation_chars, max_tokens=args.max_tokens)
        stop = threading.Event()
        service = JudgeService(config, stop)
        consumer = make_consumer(broker.bootstrap_servers, group_id=None)
        consumer.subscribe([topics.rewards])
        started = time.monotonic()
        runner = threading.Thread(target=service.run, daemon=True)
        runner.start()
        rewards: dict[str, RewardRecord] = {}
        deadline = started + 3600
        while len(rewards) < len(trajs) and time.monotonic() < deadline:
            if service.counts["judge_failures"] * args.group_size + len(rewards) >= len(trajs):
                break
            for batch in consumer.poll(timeout_ms=200).values():
                for m in batch:
                    r = decode(m.value)
                    if isinstance(r, RewardRecord) and r.judged_by == "bench":
                        rewards[r.trajectory_id] = r
        wall = time.monotonic() - started
        stop.set()
        runner.join(60)
        consumer.close()
        pairs = hits = 0.0
        by_group: dict[str, list[RewardRecord]] = {}
        for r in rewards.values():
            by_group.setdefault(r.group_id or r.trajectory_id, []).append(r)
        for members in by_group.values():
            for a in members:
                for b in members:
                    if right[a.trajectory_id] and not right[b.trajectory_id]:
                        pairs += 1
                        sa, sb = a.metrics["judge_score"], b.metrics["judge_score"]
                        hits += 1.0 if sa > sb else 0.5 if sa == sb else 0.0
        n = max(len(rewards), 1)
        results.update({
            "model": args.model or served, "trajectories": len(trajs), "judged": len(rewards),
            "groups_failed": service.counts["judge_failures"], "wall_s": round(wall, 2),
            "judged_trajectories_per_s": round(len(rewards) / wall, 2),
            "judge_prompt_tokens_per_trajectory": round(sum(r.metrics["judge_prompt_tokens"] for r in rewards.values()) / n, 1),
            "judge_completion_tokens_per_trajectory": round(
                sum(r.metrics["judge_completion_tokens"] for r in rewards.values()) / n, 1),
            "attempts_per_group": round(sum(r.metrics["judge_attempts"] for r in rewards.values()) / n, 2),
            "ranking_agreement": round(hits / pairs, 3) if pairs else None,
            "counts": dict(service.counts),
        })
    finally:
        broker.stop()
        if engine is not None:
            engine.stop()
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
