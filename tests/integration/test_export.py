"""``streamrl export`` against the embedded broker: records produced as the gateway does, exported to Parquet
and JSONL, read back (pyarrow, json) and checked field by field against what was produced."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from kafka import KafkaConsumer, TopicPartition
from kafka.structs import OffsetAndTimestamp
from support.kafka_reader import produce

from streamrl.broker import export as export_module
from streamrl.broker.embedded import EmbeddedBroker
from streamrl.broker.export import CALL, SCHEMA, ExportOptions, LogRange, _lookup, export, parse_time
from streamrl.broker.export_cli import options_from_args
from streamrl.broker.schema import CompletionRecord, JudgeRequest, PolicyRecord, RewardRecord, encode
from streamrl.broker.security import KafkaSettings
from streamrl.broker.topics import Topics, create_topics
from streamrl.cli import build_parser, main

RNG = np.random.default_rng(0)
KafkaConsumer_pause = KafkaConsumer.pause


def fresh_topics(broker: EmbeddedBroker, partitions: int = 2) -> Topics:
    """Topics of this test alone, so that what an export finds is exactly what the test produced."""
    topics = Topics(f"ex{uuid.uuid4().hex[:8]}")
    create_topics(broker.bootstrap_servers, topics, partitions=partitions)
    return topics


def options(broker: EmbeddedBroker, topics: Topics, out: Path, **kw: Any) -> ExportOptions:
    return ExportOptions(out=out,
                         kafka=KafkaSettings(bootstrap_servers=broker.bootstrap_servers, topic_prefix=topics.prefix),
                         progress=False, **kw)


def call(tid: str, request_id: str, prompt: list[int], completion: list[int], *, gid: str | None = None,
         choice: int = 0, version: int = 0, purpose: str = "train", created: float = 100.0, **kw: Any) -> CompletionRecord:
    return CompletionRecord(
        request_id=request_id, trajectory_id=tid, group_id=gid, choice_index=choice, policy_version=version,
        prompt_token_ids=np.array(prompt), completion_token_ids=np.array(completion),
        logprobs=RNG.normal(-2.0, 1.0, len(completion)).astype(np.float32), purpose=purpose, created=created,
        model="policy", policy_name="policy" if version else None, upstream="http://vllm-0", key_id="k1",
        request={"messages": [{"role": "user", "content": f"q {tid}"}], "temperature": 0.7},
        response_text=f"answer {request_id}/{choice}", finish_reason="stop", ttft_s=0.01, total_s=0.02,
        usage={"prompt_tokens": len(prompt), "completion_tokens": len(completion)}, **kw)


def check_call(row: dict[str, Any], rec: CompletionRecord) -> None:
    """Every field of the record, as exported."""
    assert row["request_id"] == rec.request_id and row["choice_index"] == rec.choice_index
    for name in ("purpose", "group_id", "key_id", "model", "endpoint", "upstream", "policy_name", "policy_version",
                 "response_text", "finish_reason", "created", "ttft_s", "total_s"):
        assert row[name] == getattr(rec, name), name
    assert row["prompt_token_ids"] == rec.prompt_token_ids.tolist()
    assert row["completion_token_ids"] == rec.completion_token_ids.tolist()
    assert np.array_equal(np.array(row["logprobs"], np.float32), rec.logprobs)  # float32, bit-exact
    assert json.loads(row["request_json"]) == rec.request
    assert json.loads(row["usage_json"]) == rec.usage
    assert (None if row["tool_calls_json"] is None else json.loads(row["tool_calls_json"])) == rec.tool_calls
    assert row["log_partition"] in (0, 1) and row["log_offset"] >= 0 and row["log_timestamp_ms"] > 0


def check_row(row: dict[str, Any], calls: list[CompletionRecord], reward: RewardRecord | None, group_id: str) -> None:
    assert row["trajectory_id"] == calls[0].trajectory_id
    assert row["group_id"] == group_id
    assert row["n_calls"] == len(calls) == len(row["calls"])
    assert [(c["request_id"], c["choice_index"]) for c in row["calls"]] == [(c.request_id, c.choice_index) for c in calls]
    for exported, rec in zip(row["calls"], calls, strict=True):
        check_call(exported, rec)
    assert row["policy_versions"] == sorted({c.policy_version for c in calls})
    assert row["key_id"] == "k1"
    if reward is None:
        assert [row[k] for k in ("reward", "group_size", "reward_metrics", "judged_by", "explanation",
                                 "reward_key_id", "reward_created")] == [None] * 7
        return
    assert row["reward"] == reward.reward and row["group_size"] == reward.group_size
    assert row["reward_metrics"] == [{"name": k, "value": v} for k, v in reward.metrics.items()]
    assert (row["judged_by"], row["explanation"], row["reward_key_id"]) == (reward.judged_by, reward.explanation, reward.key_id)
    assert row["reward_created"] == reward.created


@pytest.fixture(scope="module")
def log(broker: EmbeddedBroker) -> dict[str, Any]:
    """One log with every case: several calls per trajectory (logged out of order), n=2 choices, a duplicate
    call, an eval call, a trajectory without reward, a duplicate reward, group ids from the reward, the
    call or the trajectory, malformed records and a judge request."""
    topics = fresh_topics(broker)
    a1 = call("a", "a1", [1, 2, 3], [4, 5], gid="g1", created=100.0)
    a2 = call("a", "a2", [1, 2, 3, 4, 5, 6], [7], gid="g1", version=1, created=101.0,
              tool_calls=[{"id": "t", "type": "function", "function": {"name": "f", "arguments": "{}"}}])
    b0 = call("b", "b1", [9, 9], [8, 7, 6], gid="g1", choice=0, created=102.0)
    b1 = call("b", "b1", [9, 9], [5, 4], gid="g1", choice=1, created=102.0)
    c = call("c", "c1", [3], [3], gid="g2")
    d = call("d", "d1", [4], [4], purpose="eval")
    e = call("e", "e1", [5], [5], gid="ge")
    f = call("f", "f1", [6], [6])
    rewards = {
        "a": RewardRecord("a", 1.0, group_id="g1", group_size=2, metrics={"acc": 1.0, "len": 2.0},
                          key_id="k1", judged_by="judge-1", explanation="both right"),
        "b": RewardRecord("b", 0.5, group_id="g1", group_size=2, key_id="k1"),
        "d": RewardRecord("d", 0.3, key_id="k1"),
        "e": RewardRecord("e", -1.0, key_id="k1"),
        "f": RewardRecord("f", 0.0, key_id="k1"),
    }
    records = [a2, a1, a1, b0, b1, c, d, e, f, *rewards.values(), RewardRecord("b", 9.0, group_id="g1"),
               JudgeRequest("c", group_id="g2")]
    raw = [(topics.completions, b"not a record"), (topics.rewards, encode(c)[:-4]),
           (topics.completions, b"SRL\x01\x63" + bytes(4)),  # a completion version from the future
           (topics.completions, encode(PolicyRecord("policy", 1, "/a", "m", 1, "0" * 64)))]
    produce(broker.bootstrap_servers, topics, records, raw)
    return {"topics": topics, "n_records": len(records) + len(raw), "rewards": rewards,
            "calls": {"a": [a1, a2], "b": [b0, b1], "c": [c], "d": [d], "e": [e], "f": [f]},
            "groups": {"a": "g1", "b": "g1", "c": "g2", "d": "d", "e": "ge", "f": "f"}}


def test_the_export_covers_every_record_field() -> None:
    """A field added to a record without a column fails here (free-form dicts go as ``<name>_json``)."""
    call_columns = set(CALL.names) | {n.removesuffix("_json") for n in CALL.names}
    assert {f.name for f in dataclasses.fields(CompletionRecord)} - call_columns == {"trajectory_id"}
    reward_columns = set(SCHEMA.names) | {n.removeprefix("reward_") for n in SCHEMA.names}
    assert {f.name for f in dataclasses.fields(RewardRecord)} <= reward_columns


def test_parquet_export_reads_back_field_by_field(broker: EmbeddedBroker, log: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "log.parquet"
    summary = export(options(broker, log["topics"], out, row_group_rows=2))
    table = pq.read_table(out)
    assert table.schema.equals(SCHEMA)
    call_type = table.schema.field("calls").type.value_type
    assert call_type.field("prompt_token_ids").type == pa.list_(pa.int32())
    assert call_type.field("logprobs").type == pa.list_(pa.float32())
    assert pq.ParquetFile(out).num_row_groups == 2  # written as it went, two rows a group
    rows = {r["trajectory_id"]: r for r in table.to_pylist()}
    assert sorted(rows) == ["a", "b", "e", "f"]  # c: no reward; d: only an eval call
    for tid, row in rows.items():
        check_row(row, log["calls"][tid], log["rewards"][tid], log["groups"][tid])
    assert rows["b"]["reward"] == 0.5  # the first reward wins over the later 9.0
    assert rows["a"]["policy_versions"] == [0, 1]
    assert summary.records == log["n_records"]  # every record of the range read (none of a batch missed)
    assert (summary.rows, summary.unrewarded, summary.bytes) == (4, 1, out.stat().st_size)
    assert {k: summary.counts[k] for k in ("duplicate_completion", "duplicate_reward", "purpose_eval",
                                           "reward_without_completions", "malformed", "length_mismatch",
                                           "judge_request", "unknown_version", "wrong_topic", "completions",
                                           "rewards")} == {
        "duplicate_completion": 1, "duplicate_reward": 1, "purpose_eval": 1, "reward_without_completions": 1,
        "malformed": 1, "length_mismatch": 1, "judge_request": 1, "unknown_version": 1, "wrong_topic": 1,
        "completions": 7, "rewards": 5}
    assert not (tmp_path / "log.parquet.partial").exists()


def test_jsonl_export_with_every_purpose_and_unrewarded(broker: EmbeddedBroker, log: dict[str, Any],
                                                        tmp_path: Path) -> None:
    out = tmp_path / "log.out"
    summary = export(options(broker, log["topics"], out, format="jsonl", purpose="all", unrewarded=True))
    rows = {r["trajectory_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(rows) == ["a", "b", "c", "d", "e", "f"]
    for tid, row in rows.items():
        assert list(row) == SCHEMA.names  # the Parquet rows' shape
        assert list(row["calls"][0]) == CALL.names
        check_row(row, log["calls"][tid], log["rewards"].get(tid), log["groups"][tid])
    assert (summary.rows, summary.unrewarded) == (6, 1)
    assert summary.counts["purpose_eval"] == 0 and summary.counts["reward_without_completions"] == 0


def test_min_reward_keeps_the_best(broker: EmbeddedBroker, log: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "best.parquet"
    summary = export(options(broker, log["topics"], out, min_reward=0.5))
    assert sorted(pq.read_table(out, columns=["trajectory_id"]).column(0).to_pylist()) == ["a", "b"]
    assert summary.counts["below_min_reward"] == 2


def test_policy_keeps_one_policys_trajectories(broker: EmbeddedBroker, tmp_path: Path) -> None:
    """Several policies on one fleet share the topics: ``--policy support`` writes support's trajectories (and
    those served for no policy), never sql's, whichever comes first of a trajectory's call and reward."""
    topics = fresh_topics(broker)
    served = {"s": "support", "q": "sql", "q2": "sql", "n": None}
    calls = []
    for tid, name in served.items():
        rec = call(tid, f"{tid}-r", [1], [2])
        rec.policy_name = name
        calls.append(rec)
    rewards = [RewardRecord(tid, 1.0, policy=None) for tid in served if tid != "q2"]
    rewards.append(RewardRecord("x", 1.0, policy="sql"))  # a reward posted with a key of sql, naming sql
    produce(broker.bootstrap_servers, topics, [RewardRecord("q2", 1.0), *calls, *rewards])
    out = tmp_path / "support.parquet"
    summary = export(options(broker, topics, out, policy="support"))
    table = pq.read_table(out, columns=["trajectory_id", "policy"]).to_pylist()
    assert sorted((r["trajectory_id"], r["policy"]) for r in table) == [("n", None), ("s", "support")]
    assert summary.counts["other_policy"] == 4 and summary.counts["other_policy_reward"] == 1  # 2 calls, 2 rewards


def test_since_and_until_through_the_cli(broker: EmbeddedBroker, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    topics = fresh_topics(broker)
    now_ms = int(time.time() * 1000)
    old = [call("old", "o1", [1], [2]), RewardRecord("old", 1.0)]
    new = [call("new", "n1", [1], [2]), RewardRecord("new", 1.0)]
    produce(broker.bootstrap_servers, topics, [(r, now_ms - 3_600_000) for r in old] + [(r, now_ms) for r in new])
    flags = ["--bootstrap-servers", broker.bootstrap_servers, "--topic-prefix", topics.prefix, "--no-progress"]
    since = datetime.fromtimestamp(now_ms / 1000 - 60, UTC).isoformat()
    for out, window, kept in ((tmp_path / "new.parquet", ["--since", since], "new"),
                              (tmp_path / "old.jsonl", ["--until", str(now_ms / 1000 - 1800)], "old")):
        assert main(["export", str(out), *window, *flags]) == 0
        summary = json.loads(capsys.readouterr().out)
        rows = pq.read_table(out).to_pylist() if out.suffix == ".parquet" else [json.loads(out.read_text())]
        assert [r["trajectory_id"] for r in rows] == [kept]
        # the old records are left out by the time index (Kafka) or by their timestamps (the embedded broker)
        assert summary["rows"] == 1 and summary["records"] == 2 + summary["counts"].get("outside_time_range", 0)
        assert summary["counts"].get("rewards") == 1 and summary["counts"].get("completions") == 1


def test_the_export_stops_at_the_end_offsets_it_saw_first(broker: EmbeddedBroker, tmp_path: Path) -> None:
    topics = fresh_topics(broker, partitions=1)  # one partition: the records share batches
    produce(broker.bootstrap_servers, topics, [call("t1", "r1", [1], [2]), RewardRecord("t1", 1.0),
                                                call("t2", "r2", [1], [3])])
    opts = options(broker, topics, tmp_path / "first.parquet")
    snapshot = LogRange.snapshot(opts)
    assert snapshot.total == 3
    produce(broker.bootstrap_servers, topics, [RewardRecord("t2", 0.0), call("t3", "r3", [1], [4]),
                                                RewardRecord("t3", 1.0)])
    summary = export(opts, snapshot)
    assert pq.read_table(opts.out).column("trajectory_id").to_pylist() == ["t1"]
    assert (summary.records, summary.unrewarded) == (3, 1)  # t2's reward came after the snapshot
    later = export(dataclasses.replace(opts, out=tmp_path / "later.parquet"))
    assert sorted(pq.read_table(later.out).column("trajectory_id").to_pylist()) == ["t1", "t2", "t3"]
    assert later.records == 6


def test_trajectories_close_in_event_time_so_memory_stays_bounded(broker: EmbeddedBroker, tmp_path: Path) -> None:
    """Rewards close trajectories after the grace, idle ones expire: an export of many holds a few at once;
    records for a closed trajectory are counted late."""
    topics = fresh_topics(broker, partitions=1)
    t0 = int(time.time() * 1000) - 10_000_000
    at = lambda s: t0 + int(s * 1000)  # noqa: E731
    items = []
    for i in range(20):
        items += [(call(f"t{i}", f"r{i}", [1], [i]), at(100 * i)), (RewardRecord(f"t{i}", float(i)), at(100 * i + 1))]
    items += [(call("idle", "ri", [1], [1]), at(50)), (RewardRecord("idle", 1.0), at(500)),
              (call("t3", "r3-late", [1, 3], [1]), at(350)),
              (RewardRecord("early", 0.5), at(750)), (call("early", "re", [1], [1]), at(752))]  # within the grace
    produce(broker.bootstrap_servers, topics, sorted(items, key=lambda x: x[1]))
    out = tmp_path / "bounded.parquet"
    summary = export(options(broker, topics, out, reward_grace_s=5, open_ttl_s=30))
    rows = {r["trajectory_id"]: r for r in pq.read_table(out).to_pylist()}
    assert sorted(rows) == sorted([*(f"t{i}" for i in range(20)), "early"])
    assert rows["early"]["reward"] == 0.5 and rows["t3"]["n_calls"] == 1
    assert summary.peak_open == 1  # each closed before the next opened
    assert summary.unrewarded == 1  # idle expired 30 s after its call, long before its reward
    assert (summary.counts["late_completion"], summary.counts["late_reward"]) == (1, 1)


def test_max_open_evicts_the_longest_idle(broker: EmbeddedBroker, tmp_path: Path) -> None:
    topics = fresh_topics(broker, partitions=1)
    t0 = int(time.time() * 1000) - 1_000_000
    calls = [(call(f"x{i}", f"r{i}", [1], [i]), t0 + i) for i in range(5)]
    rewards = [(RewardRecord(f"x{i}", 1.0), t0 + 10 + i) for i in range(5)]
    produce(broker.bootstrap_servers, topics, calls + rewards)
    out = tmp_path / "evict.jsonl"
    summary = export(options(broker, topics, out, max_open=2, unrewarded=True))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["trajectory_id"], r["reward"]) for r in rows] == [
        ("x0", None), ("x1", None), ("x2", None), ("x3", 1.0), ("x4", 1.0)]
    assert summary.peak_open == 2 and summary.counts["evicted"] == 3 and summary.counts["late_reward"] == 3


def test_options_from_the_command_line(tmp_path: Path) -> None:
    parser, _ = build_parser()
    args = parser.parse_args(["export", str(tmp_path / "x.jsonl"), "--bootstrap-servers", "kafka:9093",
                              "--kafka-security-protocol", "SASL_SSL", "--kafka-sasl-mechanism", "SCRAM-SHA-512",
                              "--kafka-sasl-username", "exporter", "--purpose", "all", "--min-reward", "0.5",
                              "--unrewarded", "--since", "2026-12-01T17:00:00Z", "--until", "1796148000.5"])
    o = options_from_args(args)
    assert o.kafka == KafkaSettings(bootstrap_servers="kafka:9093", security_protocol="SASL_SSL",
                                    sasl_mechanism="SCRAM-SHA-512", sasl_username="exporter")
    assert (o.kafka.bootstrap_servers, o.purpose, o.min_reward, o.unrewarded) == ("kafka:9093", "all", 0.5, True)
    assert (o.since_ms, o.until_ms) == (1796144400000, 1796148000500)
    assert o.resolved_format() == "jsonl"
    assert parse_time("2026-12-01T18:00:00+01:00") == parse_time("2026-12-01T17:00:00") == 1796144400000
    with pytest.raises(ValueError, match="format"):
        ExportOptions(out=Path("x.csv")).resolved_format()
    assert main(["export", str(tmp_path / "x.csv")]) == 2  # refused before any connection
    with pytest.raises(ValueError, match="since is after until"):
        ExportOptions(since_ms=2, until_ms=1)


def test_a_partitions_buffer_pauses_its_fetching_without_changing_the_export(
        broker: EmbeddedBroker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With small fetches and a buffer of 50 records a partition, the merge pauses and resumes partitions
    all the way through, and exports the same."""
    topics = fresh_topics(broker)
    t0 = int(time.time() * 1000) - 1_000_000
    for chunk in range(0, 600, 30):  # a batch of records per partition each; the rewards after every call,
        produce(broker.bootstrap_servers, topics, [  # so their partitions fill up while the calls are merged
            item for i in range(chunk, chunk + 30)
            for item in ((call(f"t{i}", f"r{i}", [1, i], [i]), t0 + i), (RewardRecord(f"t{i}", float(i)), t0 + 1000 + i))])
    reference = export(options(broker, topics, tmp_path / "ref.parquet"))
    monkeypatch.setattr(export_module, "BUFFER_RECORDS", 50)
    monkeypatch.setattr(export_module, "FETCH_BYTES", 4096)  # a few dozen records a fetch
    paused = []
    monkeypatch.setattr(KafkaConsumer, "pause", lambda self, *tps: paused.extend(tps) or KafkaConsumer_pause(self, *tps))
    small = export(options(broker, topics, tmp_path / "small.parquet"))
    assert paused  # the limit was hit
    assert small.rows == reference.rows == 600 and small.peak_open <= reference.peak_open
    assert pq.read_table(small.out).equals(pq.read_table(reference.out))


class FakeIndexConsumer:
    """A partition whose records have the timestamps ``stamps``, and a broker answering ``answer``."""

    def __init__(self, stamps: list[int], answer: OffsetAndTimestamp | None) -> None:
        self.stamps, self.answer, self.at = stamps, answer, 0

    def offsets_for_times(self, query: dict) -> dict:
        return dict.fromkeys(query, self.answer)

    def assign(self, tps: list) -> None:
        pass

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.at = offset

    def poll(self, timeout_ms: int, max_records: int) -> dict:
        return {TP: [SimpleNamespace(timestamp=self.stamps[self.at])]}

    def unsubscribe(self) -> None:
        pass


TP = TopicPartition("x.completions", 0)


@pytest.mark.parametrize(("answer", "expected"), [
    (OffsetAndTimestamp(2, 30, 0), {TP: 2}),  # Kafka's answer for 25: used
    (OffsetAndTimestamp(0, 40, 0), {}),  # the embedded broker's (offset 0, newest time): not used, read and filter
    (None, {TP: 4}),  # Kafka: no record at or after 25: the end
])
def test_a_time_index_answer_is_used_only_when_it_checks_out(answer: OffsetAndTimestamp | None, expected: dict) -> None:
    consumer = FakeIndexConsumer([10, 20, 30, 40], answer)
    assert _lookup(consumer, [TP], 25, {TP: 4}) == expected  # type: ignore[arg-type]


def test_the_docs_sft_example_with_datasets(broker: EmbeddedBroker, log: dict[str, Any], tmp_path: Path) -> None:
    """docs/export.md's example, as written: the best trajectories' last calls as SFT examples."""
    datasets = pytest.importorskip("datasets")
    out = tmp_path / "run.parquet"
    export(options(broker, log["topics"], out))
    ds = datasets.load_dataset("parquet", data_files=str(out), split="train", cache_dir=str(tmp_path / "cache"))
    best = ds.filter(lambda row: row["reward"] is not None and row["reward"] >= 1.0)

    def tokens(row: dict[str, Any]) -> dict[str, Any]:
        last = row["calls"][-1]
        ids = last["prompt_token_ids"] + last["completion_token_ids"]
        labels = [-100] * len(last["prompt_token_ids"]) + last["completion_token_ids"]
        return {"input_ids": ids, "labels": labels}

    sft = best.map(tokens, remove_columns=best.column_names)
    a2 = log["calls"]["a"][-1]
    assert sft["input_ids"] == [a2.prompt_token_ids.tolist() + a2.completion_token_ids.tolist()]
    assert sft["labels"] == [[-100] * len(a2.prompt_token_ids) + a2.completion_token_ids.tolist()]
