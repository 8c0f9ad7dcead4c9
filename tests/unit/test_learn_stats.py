"""The learning benchmark's statistics (bench/learn_stats.py), its presets (bench/learn_presets.py) and its run
order: level crossings, censoring, seeded bootstrap intervals, merging result files, TOML presets."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from support.bench_module import load_bench

stats = load_bench("learn_stats")
presets = load_bench("learn_presets")

CURVE = [(5.0, 0, 0.10), (20.0, 3, 0.30), (35.0, 6, float("nan")), (50.0, 9, 0.55), (80.0, 14, 0.52)]
FAST = 200
"""Bootstrap resamples in these tests: enough to check the arithmetic, quick on a busy machine."""


def test_first_crossing_is_the_first_point_at_or_above_the_level() -> None:
    assert stats.first_crossing(CURVE, 0.3) == 20.0  # at the level counts
    assert stats.first_crossing(CURVE, 0.31) == 50.0
    assert stats.first_crossing(CURVE, 0.1) == 5.0
    assert stats.first_crossing(CURVE, 0.6) is None  # never: censored
    assert stats.first_crossing([(1.0, 0, float("nan"))], 0.0) is None  # a NaN evaluation is no score


def test_score_at_is_the_last_point_at_or_before_and_nothing_past_the_end() -> None:
    assert stats.score_at(CURVE, 4.9) is None  # no evaluation yet
    assert stats.score_at(CURVE, 5.0) == 0.10
    assert stats.score_at(CURVE, 40.0) == 0.30  # the NaN at 35 s is skipped
    assert stats.score_at(CURVE, 100.0, end_s=90.0) is None  # the run had ended
    assert stats.score_at(CURVE, 85.0, end_s=90.0) == 0.52


def test_speedups_pair_by_seed_and_treat_not_reached_as_infinite() -> None:
    sync = {0: 100.0, 1: None, 2: 60.0, 3: None, 4: 30.0}
    pipeline = {0: 50.0, 1: 80.0, 2: None, 3: None}
    ratios, neither = stats.speedups(sync, pipeline)
    assert ratios == {0: 2.0, 1: math.inf, 2: 0.0}  # seed 4 has no pipeline run: unpaired
    assert neither == 1


def test_median_with_not_reached_runs() -> None:
    assert stats.median([1.0, 2.0, math.inf]) == 2.0
    assert stats.median([1.0, math.inf]) == math.inf  # half not reached: not reached
    assert math.isnan(stats.median([]))


def test_bootstrap_interval_is_seeded_and_brackets_the_median() -> None:
    values = [1.2, 0.9, 2.1, 1.5, 1.1, 3.0, 1.4]
    a = stats.bootstrap_median_interval(values, resamples=FAST, seed=7)
    assert a == stats.bootstrap_median_interval(values, resamples=FAST, seed=7)
    low, high = a
    assert low <= stats.median(values) <= high
    assert min(values) <= low and high <= max(values)
    assert stats.bootstrap_median_interval([2.0], resamples=FAST) == (2.0, 2.0)
    assert stats.bootstrap_median_interval([math.inf, math.inf], resamples=FAST) == (math.inf, math.inf)
    assert stats.bootstrap_median_interval([], resamples=FAST) is None


def test_quantiles() -> None:
    assert stats.nearest_rank([5, 1, 3, 2, 4], 0.5) == 3
    assert stats.nearest_rank(range(1, 101), 0.99) == 99
    assert stats.nearest_rank([], 0.5) is None
    assert stats.weighted_quantile([(0.0, 90), (3.0, 10)], 0.9) == 0.0
    assert stats.weighted_quantile([(0.0, 89), (3.0, 11)], 0.9) == 3.0
    assert stats.weighted_quantile([(1.0, 0)], 0.5) is None


def test_staleness_is_weighted_by_sampled_tokens() -> None:
    history = [{"staleness_mean": 0.0, "staleness_max": 0, "sampled_tokens": 300},
               {"staleness_mean": 2.0, "staleness_max": 4, "sampled_tokens": 100}]
    old = "trainer history, step means weighted by tokens"
    assert stats.staleness_per_token(history) == {"source": old, "mean": 0.5, "p90": 2.0, "max": 4.0}
    assert stats.staleness_per_token([]) == {"source": old, "mean": None, "p90": None, "max": None}


def test_staleness_is_exact_from_the_histograms() -> None:
    """Per token over the run: 850 tokens at 0, 100 at 1, 50 at 3; the step means would say max 1.5."""
    history = [{"staleness_mean": 0.2, "staleness_max": 1, "sampled_tokens": 500,
                "staleness_tokens": {"0": 450, "1": 50}},
               {"staleness_mean": 1.5, "staleness_max": 3, "sampled_tokens": 500,
                "staleness_tokens": {"0": 400, "1": 50, "3": 50, "7": 0}}]
    exact = stats.staleness_per_token(history)
    assert exact == {"source": "trainer history, per token", "mean": (100 + 150) / 1000, "p90": 1.0, "max": 3.0,
                     "shares": {"0": 0.85, "1": 0.1, "2+": 0.05}}
    history[1]["staleness_tokens"] = {"0": 390, "3": 110}  # 11% of the run's tokens at 3: p90 at 3
    assert stats.staleness_per_token(history)["p90"] == 3.0
    del history[0]["staleness_tokens"]  # an older step without its histogram: the estimate for the whole run
    assert stats.staleness_per_token(history)["source"] == "trainer history, step means weighted by tokens"


def test_the_trainers_waiting_share_leaves_out_the_first_step() -> None:
    """The first step's wait is the run's start-up; after it, waits of 1 + 3 s against 4 s of steps and 2 s of
    saving and announcing: 40%."""
    history = [{"wait_s": 60.0, "step_s": 1.0},
               {"wait_s": 1.0, "step_s": 2.0, "adapter_s": 0.5, "checkpoint_s": 0.25, "announce_s": 0.25},
               {"wait_s": 3.0, "step_s": 2.0, "adapter_s": 1.0}]
    assert stats.trainer_waiting(history) == 0.4
    assert stats.trainer_waiting(history[:1]) is None and stats.trainer_waiting([]) is None


def test_multi_call_merging_is_summed_over_the_run() -> None:
    history = [{"trajectories_multi_call": 16, "trajectories_split": 0},
               {"trajectories_multi_call": 16, "trajectories_split": 5}, {"trajectories_multi_call": 3}]
    assert stats.merging(history) == {"multi_call": 35, "merged": 30, "split": 5}
    assert stats.merging([{"staleness_mean": 0.0}]) is None  # written before the trainer counted them


def test_reply_length_from_the_demo_summary_else_the_history() -> None:
    history = [{"sampled_tokens": 640, "sequences": 10}, {"sampled_tokens": 1280, "sequences": 10},
               {"sampled_tokens": 100, "sequences": 0}]
    from_history = stats.reply_tokens(history, {})
    assert (from_history["p50"], from_history["p90"], from_history["max"]) == (64.0, 128.0, 128.0)
    own = stats.reply_tokens(history, {"reply_tokens": {"p50": 40, "p90": 700, "max": 768, "n": 96}})
    assert own == {"source": "demo summary, per reply", "p50": 40, "p90": 700, "max": 768, "n": 96}
    assert stats.reply_tokens(history, {"reply_tokens": None})["source"] == "trainer history, mean per step"


def test_served_reward_curve_keeps_whole_groups_of_known_versions() -> None:
    versions = {"-1": {"n": 8, "mean": 0.1, "last_s": 1.0}, "0": {"n": 16, "mean": 0.4, "last_s": 9.0},
                "1": {"n": 3, "mean": 0.9, "last_s": 11.0}, "2": {"n": 8, "mean": 0.6, "last_s": 14.0}}
    assert stats.served_reward_curve(versions, 8) == [(9.0, 0, 0.4), (14.0, 2, 0.6)]


def run(mode: str, seed: int, curve: list[tuple[float, int, float]], **extra: object) -> dict:
    """A run record as the harness writes it, with what the statistics read."""
    return {"mode": mode, "seed": seed, "order": 0, "complete": True, "curve": curve, "end_s": 120.0,
            "score_source": "held-out", "versions_per_s": 0.5, "staleness": {"mean": 1.0, "p90": 2.0, "max": 3.0},
            "reply_tokens": {"source": "x", "p50": 60.0, "p90": 120.0, "max": 128.0}, "engine_idle_s": 10.0,
            "engine_idle_frac": 0.1, "publish_to_served": {"ms": [100, 200, 600]}, "requests_failed": 0,
            "trajectories_failed": 0, **extra}


def rising(t_half: float) -> list[tuple[float, int, float]]:
    """0.1 at 5 s, 0.3 at t_half / 2, 0.5 at t_half."""
    return [(5.0, 0, 0.1), (t_half / 2, 1, 0.3), (t_half, 2, 0.5)]


RUNS = [run("pipeline", 0, rising(40.0)), run("sync", 0, rising(80.0)),
        run("sync", 1, rising(90.0)), run("pipeline", 1, rising(30.0)),
        run("pipeline", 2, rising(100.0)), run("sync", 2, [(5.0, 0, 0.1), (50.0, 1, 0.3)]),
        run("sync", 3, rising(20.0), complete=False, why="cut short by the time budget")]


def test_compute_levels_censoring_and_paired_speedup() -> None:
    s = stats.compute(RUNS, levels=[0.3, 0.5], times_s=[60.0], resamples=FAST)
    assert s["seeds"] == {"pipeline": [0, 1, 2], "sync": [0, 1, 2]}  # the cut run is left out
    assert s["left_out"] == [{"mode": "sync", "seed": 3, "why": "cut short by the time budget"}]
    half = s["levels"][1]
    assert half["level"] == 0.5
    assert half["modes"]["pipeline"]["median"] == 40.0
    assert half["modes"]["pipeline"]["reached"] == 3
    assert half["modes"]["sync"]["per_seed"] == {"0": 80.0, "1": 90.0, "2": math.inf}
    assert half["modes"]["sync"]["not_reached"] == 1 and half["modes"]["sync"]["median"] == 90.0
    speedup = half["speedup"]["pipeline/sync"]
    assert speedup["per_seed"] == {"0": 2.0, "1": 3.0, "2": math.inf}
    assert speedup["median"] == 3.0 and speedup["neither_reached"] == 0
    low, high = speedup["interval_90"]
    assert 2.0 <= low <= 3.0 <= high
    at60 = s["at_times"][0]
    assert at60["score"]["pipeline"]["per_seed"] == {"0": 0.5, "1": 0.5, "2": 0.3}
    assert at60["gain"]["sync"]["per_seed"] == {"0": pytest.approx(0.2), "1": pytest.approx(0.2),
                                                "2": pytest.approx(0.2)}
    figures = s["modes"]["pipeline"]
    assert figures["publish_to_served_ms"] == {"versions": 9, "p50": 200, "p99": 600, "max": 600, "over_500": 3}
    assert figures["versions_per_s"]["median"] == 0.5 and figures["staleness_per_token"]["max"] == 3.0


def test_held_out_success_at_each_time_where_runs_have_it() -> None:
    """A game's runs: the mean score rises, and the share of games won (``success_curve``) with it; runs without a
    success curve (a task with no held-out set) are not counted as missing."""
    won = [run("pipeline", 0, rising(40.0), success_curve=[(5.0, 0, 0.0), (40.0, 2, 0.25)]),
           run("pipeline", 1, rising(30.0), success_curve=[(5.0, 0, 0.0), (15.0, 1, 0.5)]),
           run("sync", 0, rising(80.0))]
    at60 = stats.compute(won, levels=[0.5], times_s=[60.0], resamples=FAST)["at_times"][0]
    assert at60["success"]["pipeline"]["per_seed"] == {"0": 0.25, "1": 0.5}
    assert at60["success_gain"]["pipeline"]["median"] == pytest.approx(0.375)
    assert at60["success"]["sync"] == {**at60["success"]["sync"], "n": 0, "missing": 0}
    assert at60["score"]["sync"]["per_seed"] == {"0": 0.3}


def test_compute_without_the_baseline_has_no_speedup() -> None:
    s = stats.compute([r for r in RUNS if r["mode"] == "pipeline"], levels=[0.5], times_s=[60.0], resamples=FAST)
    assert s["levels"][0]["speedup"] == {}


def result(runs: list[dict], **preset: object) -> dict:
    return {"bench": "learn_bench", "preset": {"name": "short", "levels": [0.3, 0.5], "times_s": [60.0], **preset},
            "baseline": "sync", "runs": runs, "skipped": []}


def test_merge_pools_the_seeds_and_recomputes() -> None:
    a, b = result(RUNS[:2]), result(RUNS[2:])
    merged = stats.merge([a, b], ["a.json", "b.json"], resamples=FAST)
    assert merged["seeds"] == [0, 1, 2, 3]
    assert [r["source"] for r in merged["runs"]].count("a.json") == 2
    direct = stats.compute(RUNS, levels=[0.3, 0.5], times_s=[60.0], resamples=FAST)
    assert merged["stats"]["levels"] == direct["levels"]
    assert json.loads(json.dumps(stats.jsonable(merged), allow_nan=False))["stats"]["levels"][1]["modes"]["sync"][
        "per_seed"]["2"] == "inf"


def test_merge_refuses_other_presets_and_runs_twice_but_replaces_a_cut_run() -> None:
    with pytest.raises(stats.MergeError, match="max_tokens"):
        stats.merge([result(RUNS[:2]), result(RUNS[2:4], max_tokens=768)], resamples=FAST)
    assert stats.merge([result(RUNS[:2]), result(RUNS[2:4], max_tokens=768)], allow_other_presets=True,
                       resamples=FAST)["runs"]
    with pytest.raises(stats.MergeError, match="pipeline seed 0"):
        stats.merge([result(RUNS[:2]), result(RUNS[:1])], resamples=FAST)
    redone = run("sync", 3, rising(25.0))
    cut = result(RUNS)
    cut["skipped"] = [{"mode": "pipeline", "seed": 3, "why": "time budget"}]
    merged = stats.merge([cut, result([redone])], resamples=FAST)
    assert merged["stats"]["seeds"]["sync"] == [0, 1, 2, 3]
    assert merged["stats"]["left_out"] == []
    assert merged["skipped"] == [{"mode": "pipeline", "seed": 3, "why": "time budget", "source": "#0"}]


def test_merge_measures_speedups_against_the_baseline_asked_for() -> None:
    merged = stats.merge([result(RUNS[:2]), result(RUNS[2:])], baseline="pipeline", resamples=FAST)
    assert merged["baseline"] == "pipeline"
    assert list(merged["stats"]["levels"][0]["speedup"]) == ["sync/pipeline"]
    with pytest.raises(stats.MergeError, match="baseline inflight is not among the pooled modes"):
        stats.merge([result(RUNS)], baseline="inflight", resamples=FAST)


def test_jsonable_is_strict_json() -> None:
    assert stats.jsonable({"a": (1.0, math.inf, -math.inf, math.nan), 2: [None]}) == \
        {"a": [1.0, "inf", "-inf", None], "2": [None]}


def test_labelled_runs_reads_old_and_new_results() -> None:
    assert list(stats.labelled_runs({"modes": {"pipeline": {}, "sync": {}}})) == ["pipeline", "sync"]
    assert list(stats.labelled_runs(result(RUNS[:2]))) == ["pipeline s0", "sync s0"]


def test_preset_file_starts_from_a_builtin_and_checks_keys_and_types(tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text('[long-1k]\nbase = "long-tail"\nmax_tokens = 1024\nlevels = [0.3, 1]\n\n'
                    '[longer]\nbase = "long-1k"\nmax_seconds = 200\n')
    loaded = presets.load_preset_file(path)
    assert loaded["long-1k"].max_tokens == 1024 and loaded["long-1k"].concurrency == 32
    assert loaded["long-1k"].levels == (0.3, 1.0)
    assert loaded["longer"].max_tokens == 1024 and loaded["longer"].max_seconds == 200.0
    path.write_text('[x]\nbase = "short"\nmax_token = 5\n')
    with pytest.raises(ValueError, match="did you mean 'max_tokens'"):
        presets.load_preset_file(path)
    path.write_text('[x]\nconcurrency = "many"\n')
    with pytest.raises(ValueError, match="concurrency must be int"):
        presets.load_preset_file(path)
    path.write_text('[x]\nlayout = "three-gpu"\n')
    with pytest.raises(ValueError, match="layout must be one of"):
        presets.load_preset_file(path)
    path.write_text('[mail]\nbase = "agent"\ntask = "examples.email_search.agent:EmailTask"\n'
                    'task_options = {first_tool = "search_inbox", n_emails = 300}\n')
    mail = presets.load_preset_file(path)["mail"]
    assert mail.task_options == {"first_tool": "search_inbox", "n_emails": 300}
    path.write_text(presets.preset_toml(mail))  # and back, as `learn_bench.py presets` prints it
    assert presets.load_preset_file(path)["mail"] == mail
    path.write_text('[x]\ntask_options = "first_tool=search_inbox"\n')
    with pytest.raises(ValueError, match="task_options must be a table"):
        presets.load_preset_file(path)


def test_every_builtin_preset_round_trips_through_toml(tmp_path: Path) -> None:
    path = tmp_path / "all.toml"
    path.write_text("\n\n".join(presets.preset_toml(p) for p in presets.PRESETS.values()))
    assert presets.load_preset_file(path, known={}) == presets.PRESETS
    assert presets.PRESETS["long-tail"].max_tokens == 768 and presets.PRESETS["long-tail"].concurrency == 32
    assert presets.PRESETS["agent"].task == "examples.tictactoe.agent:TicTacToeTask"


def test_runs_are_interleaved_and_the_first_mode_turns_with_the_seed() -> None:
    bench = load_bench("learn_bench")
    assert bench.run_order([0, 1, 2], ["pipeline", "sync"]) == [
        (0, "pipeline"), (0, "sync"), (1, "sync"), (1, "pipeline"), (2, "pipeline"), (2, "sync")]
    assert bench.run_order([5], ["pipeline", "sync"]) == [(5, "sync"), (5, "pipeline")]
    assert bench.parse_modes("pipeline,sync-json") == ["pipeline", "sync-json"]
    with pytest.raises(ValueError, match="unknown mode"):
        bench.parse_modes("pipeline,async")


def test_a_modes_gateway_settings_reach_streamrl_up(tmp_path: Path) -> None:
    """``pipeline-room`` gives the gateway room for one more version; the file it writes is one ``streamrl up``
    takes (its own checker reads every table), and other modes leave the gateway's default."""
    from streamrl.cli.up_config import load_config

    bench = load_bench("learn_bench")
    for mode, room, cache in (("pipeline-room", 4, "keep"), ("pipeline", 3, "keep"), ("inflight-recompute", 3, "recompute")):
        config = bench.up_config(presets.PRESETS["long-tail"], bench.RunSpec(mode, 0, 0), tmp_path / "model",
                                 tmp_path / "run", 8080, 8081, ["http://127.0.0.1:9"])
        path = tmp_path / f"{mode}.json"
        path.write_text(json.dumps(config))
        gateway = load_config(path).gateway_config(["http://127.0.0.1:9"], "127.0.0.1:9092", 8080)
        assert (gateway.max_loaded_versions, gateway.in_flight_cache) == (room, cache)


def test_merge_reads_a_field_a_file_lacks_as_its_default() -> None:
    old = result(RUNS[:2])  # written before presets had task_options
    new = result(RUNS[2:], task_options={})
    with pytest.raises(stats.MergeError, match="task_options"):
        stats.merge([old, new], resamples=FAST)
    assert stats.merge([old, new], defaults={"task_options": {}}, resamples=FAST)["seeds"] == [0, 1, 2, 3]
    with pytest.raises(stats.MergeError, match="task_options"):  # a value other than the default still differs
        stats.merge([old, result(RUNS[2:], task_options={"first_tool": "x"})], defaults={"task_options": {}},
                    resamples=FAST)


def test_field_defaults_are_what_a_preset_of_no_settings_writes() -> None:
    defaults = presets.field_defaults()
    assert defaults["task_options"] == {} and defaults["levels"] == [0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]
    assert defaults["name"] == presets.Preset().name


def test_serve_writes_the_urls_whole_once_the_engines_answer_and_removes_them_when_stopped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``learn_bench.py serve`` (the engine kept between a device's commands): the engines here are stand-ins (a
    real engine's start and stop are the session engine's, tests/integration); what is checked is the URL file a
    waiting script reads: absent until every engine answers, whole, and gone once the engines are stopped."""
    import argparse
    import threading

    bench = load_bench("learn_bench")
    started = threading.Event()
    stopped: list[str] = []

    class StandIn:
        def __init__(self, url: str) -> None:
            self.url = url

        def stop(self) -> None:
            stopped.append(self.url)

    def start(preset: object, model: Path, out: Path) -> list[StandIn]:
        assert not urls.exists(), "the URL file is written only once every engine answers"
        started.set()
        return [StandIn("http://127.0.0.1:1"), StandIn("http://127.0.0.1:2")]

    monkeypatch.setattr(bench, "build_model", lambda preset, cache, out: tmp_path / "model")
    monkeypatch.setattr(bench, "start_shared_engines", start)
    urls = tmp_path / "engine.urls"
    args = argparse.Namespace(out=str(tmp_path / "out"), model_cache=str(tmp_path / "cache"), urls=str(urls))
    stop = threading.Event()
    thread = threading.Thread(target=bench.serve, args=(args, presets.PRESETS["tiny"], stop))
    thread.start()
    try:
        assert started.wait(10)
        for _ in range(1000):
            if urls.exists():
                break
            stop.wait(0.01)
        assert urls.read_text() == "http://127.0.0.1:1\nhttp://127.0.0.1:2\n" and not stopped
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive() and stopped == ["http://127.0.0.1:1", "http://127.0.0.1:2"] and not urls.exists()


def test_the_engine_timeline_names_versions_whose_requests_waited_for_a_lora_slot() -> None:
    """vLLM's ``lora_requests_info`` keeps every label set it was ever set with, each at the time of its last
    update: the latest is the engine's state. A version waiting while ``max_lora`` others run waits for a slot;
    one waiting beside a free slot (a full KV cache, say) does not count."""
    bench = load_bench("learn_bench")

    def info(t: float, running: str, waiting: str, max_lora: int = 2) -> dict[str, float]:
        return {f'vllm:lora_requests_info{{max_lora="{max_lora}",running_lora_adapters="{running}",'
                f'waiting_lora_adapters="{waiting}"}}': t}

    full = {**info(100.0, "p@v1", ""), **info(101.0, "p@v1,p@v2", "p@v3")}
    assert bench.lora_slot_waits(full) == ["p@v3"]
    assert bench.lora_slot_waits({**full, **info(102.0, "p@v2,p@v3", "")}) == []  # later: v3 runs
    assert bench.lora_slot_waits(info(101.0, "p@v1", "p@v3")) == []  # a slot free: not a slot wait
    assert bench.lora_slot_waits(info(101.0, "p@v1,p@v2", "p@v2,p@v3", max_lora=3)) == []
    assert bench.lora_slot_waits({"vllm:num_requests_running": 3.0}) == []  # LoRA off, or an older vLLM
    base = {"vllm:num_requests_running": 4.0, "vllm:generation_tokens_total": 0.0}
    samples = [(10.0, {**base, **info(100.0, "p@v1", "")}),
               (11.0, {**base, "vllm:generation_tokens_total": 50.0, **full}),
               (12.5, {**base, "vllm:generation_tokens_total": 90.0, **full, **info(102.0, "p@v2,p@v3", "")})]
    timeline = bench.engine_timeline(samples, t0=10.0)
    assert (timeline["lora_slot_wait_s"], timeline["lora_slot_waited"]) == (1.0, ["p@v3"])
