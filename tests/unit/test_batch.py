"""The Arrow batch contract: built once per step, read through zero-copy views, written and read back
bit-exact as Parquet and as Arrow IPC, older versions read and newer or malformed ones refused."""

from __future__ import annotations

import io
import re
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.records import call

from streamrl.broker.schema import RewardRecord
from streamrl.trainer.assembler import Assembler, ReadyGroup
from streamrl.trainer.batch import (
    BATCH_SCHEMA,
    Batch,
    BatchError,
    batch_seq,
    group_slices,
    read_batch,
    sequences_batch,
    step_batch,
    with_seq,
)
from streamrl.trainer.batch_io import (
    IpcStreamWriter,
    read_ipc_file,
    read_ipc_stream,
    read_parquet,
    save_parquet,
    write_ipc_file,
)
from streamrl.trainer.feed import ReplayBatches
from streamrl.trainer.feed_state import FeedLog, FeedState, FeedStateError


def ready(gid: str, rewards: tuple[float, ...], temperature: float | None = None) -> ReadyGroup:
    """A ready group of one multi-turn trajectory per reward (two calls, merged into one sequence)."""
    a = Assembler(group_size=len(rewards), group_timeout_s=60, ttl_s=600, max_trajectories=100)
    request = {"temperature": temperature} if temperature is not None else {}
    for i, r in enumerate(rewards):
        t = f"{gid}-{i}"
        a.add(call(t, [1, 2], [3, 4 + i], gid=gid, request=request), b"", now=0)
        a.add(call(t, [1, 2, 3, 4 + i, 9], [5, 6, 7], gid=gid, request=request), b"", now=0)
        a.add(RewardRecord(t, r, group_id=gid), b"", now=0)
    [g] = a.poll(now=0)
    return g


def two_groups() -> pa.RecordBatch:
    return step_batch([ready("g1", (1.0, 0.0)), ready("g2", (0.0, 2.0, 1.0), temperature=0.7)], std_norm=False,
                      counts=Counter())


def test_a_step_is_one_record_batch_and_its_view_reads_the_arrow_buffers() -> None:
    record = two_groups()
    assert record.schema.equals(BATCH_SCHEMA, check_metadata=True) and record.num_rows == 5
    view = Batch.of(record)
    assert view.group_ids == ["g1", "g2"] and view.trajectory_ids == ["g1-0", "g1-1", "g2-0", "g2-1", "g2-2"]
    # merged: prompt 1 2, sampled 3 x, tool result 9, sampled 5 6 7
    assert view.token_ids[1].tolist() == [1, 2, 3, 5, 9, 5, 6, 7]
    assert view.loss_mask[1].tolist() == [0, 0, 1, 1, 0, 1, 1, 1]
    assert view.advantage.tolist() == pytest.approx([0.5, -0.5, -1.0, 1.0, 0.0])
    assert view.temperature.tolist() == pytest.approx([1.0, 1.0, 0.7, 0.7, 0.7])
    assert view.sampled_tokens() == 5 * 5
    for name in ("token_ids", "loss_mask", "behaviour_logprobs"):  # zero copy: the numpy arrays are Arrow's memory
        values = getattr(view, name).values
        assert values.ctypes.data == record.column(name).values.buffers()[1].address
    assert view.advantage.ctypes.data == record.column("advantage").buffers()[1].address
    parts = group_slices(record)
    assert [p.num_rows for p in parts] == [2, 3] and Batch.of(parts[1]).token_ids[0].tolist() == view.token_ids[2].tolist()


def assert_bit_exact(a: pa.RecordBatch, b: pa.RecordBatch) -> None:
    assert a.equals(b) and a.schema.metadata == b.schema.metadata
    va, vb = Batch.of(a), Batch.of(b)
    for name in ("token_ids", "loss_mask", "behaviour_logprobs"):
        ra, rb = getattr(va, name), getattr(vb, name)
        assert ra.values[ra.offsets[0]:ra.offsets[-1]].tobytes() == rb.values[rb.offsets[0]:rb.offsets[-1]].tobytes()
        assert ra.lengths.tolist() == rb.lengths.tolist()
    for name in ("advantage", "reward", "policy_version", "temperature"):
        assert getattr(va, name).tobytes() == getattr(vb, name).tobytes()


def test_parquet_and_ipc_round_trips_are_bit_exact(tmp_path) -> None:
    record = with_seq(two_groups(), 7)
    assert_bit_exact(read_parquet(save_parquet(record, tmp_path, "00000001-000")), record)
    back = read_ipc_file(write_ipc_file(record, tmp_path / "7.arrow"))
    assert_bit_exact(back, record) and batch_seq(back) == 7
    sink = io.BytesIO()
    writer = IpcStreamWriter(sink)
    second = with_seq(step_batch([ready("g3", (3.0, 1.0))], std_norm=True), 8)
    writer.write(record)
    writer.write(second)
    writer.close()
    got = list(read_ipc_stream(pa.BufferReader(sink.getvalue())))
    assert [batch_seq(r) for r in got] == [7, 8]
    assert_bit_exact(got[0], record) and assert_bit_exact(got[1], second)
    # a slice (one group of a step, as --save-batches writes it) round-trips as the slice
    part = group_slices(record)[1]
    assert read_parquet(save_parquet(part, tmp_path, "00000001-001")).equals(part)


def test_a_version_1_batch_is_read_at_temperature_one(tmp_path) -> None:
    record = step_batch([ready("g", (1.0, 0.0))], std_norm=False)
    old = pa.Table.from_batches([record]).drop_columns(["temperature", "token_versions"]).replace_schema_metadata(
        {"streamrl.batch_version": "1"})
    pq.write_table(old, tmp_path / "old.parquet")
    back = read_parquet(tmp_path / "old.parquet")
    assert Batch.of(back).temperature.tolist() == [1.0, 1.0]
    assert back.drop_columns(["temperature"]).equals(record.drop_columns(["temperature"]))
    assert back.schema.metadata[b"streamrl.batch_version"] == b"3"


def test_a_version_2_batch_has_every_token_at_its_sequences_version(tmp_path) -> None:
    """Before requests could move between versions mid-way, a sequence's tokens all came from its one version."""
    record = step_batch([ready("g", (1.0, 0.0))], std_norm=False)
    versions = Batch.of(record).token_versions
    assert all((versions[i] == record.column("policy_version")[i].as_py()).all() for i in range(record.num_rows))
    old = pa.Table.from_batches([record]).drop_columns(["token_versions"]).replace_schema_metadata(
        {"streamrl.batch_version": "2"})
    pq.write_table(old, tmp_path / "old.parquet")
    assert read_parquet(tmp_path / "old.parquet").equals(record)


@pytest.mark.parametrize(("change", "reason", "message"), [
    (lambda r: r.replace_schema_metadata({"streamrl.batch_version": "4"}), "batch_unknown_version",
     "batch version 4: this streamrl reads versions 1 to 3 (upgrade streamrl"),
    (lambda r: r.replace_schema_metadata({}), "batch_no_version", "not a streamrl batch"),
    (lambda r: r.replace_schema_metadata({"streamrl.batch_version": "two"}), "batch_bad_version", "not a number"),
    (lambda r: r.drop_columns(["advantage"]), "batch_malformed", "without column(s) advantage"),
    (lambda r: r.set_column(r.schema.get_field_index("reward"), "reward", pa.array([None, 1.0], pa.float32())),
     "batch_malformed", "column reward holds 1 null"),
    (lambda r: r.set_column(r.schema.get_field_index("loss_mask"), "loss_mask", pa.array([[1], [1]], pa.list_(pa.int8()))),
     "batch_malformed", "differ in length"),
    (lambda r: r.set_column(r.schema.get_field_index("token_ids"), "token_ids", pa.array([["a"], ["b"]])),
     "batch_malformed", "column token_ids is list<item: string>"),
])
def test_a_newer_or_malformed_batch_is_refused_with_a_clear_error(change, reason, message) -> None:
    record = step_batch([ready("g", (1.0, 0.0))], std_norm=False)
    with pytest.raises(BatchError, match=re.escape(message)) as err:
        read_batch(change(record))
    assert err.value.reason == reason


def test_columns_of_a_wider_type_are_cast_and_others_kept_as_they_are() -> None:
    record = step_batch([ready("g", (1.0, 0.0))], std_norm=False)
    wide = record.set_column(record.schema.get_field_index("token_ids"), "token_ids",
                             record.column("token_ids").cast(pa.list_(pa.int64())))
    back = read_batch(wide)
    assert back.equals(record)
    assert back.column("loss_mask").values.buffers()[1].address == record.column("loss_mask").values.buffers()[1].address


def test_replay_skips_and_counts_a_batch_it_cannot_read(tmp_path) -> None:
    good = step_batch([ready("g1", (1.0, 0.0))], std_norm=False)
    save_parquet(good, tmp_path, "00000001-000")
    save_parquet(good.replace_schema_metadata({"streamrl.batch_version": "9"}), tmp_path, "00000001-001")
    save_parquet(step_batch([ready("g2", (0.0, 1.0))], std_norm=False), tmp_path, "00000002-000")
    replay = ReplayBatches(str(tmp_path))
    first = replay.next_batch(2, 0, 0)
    assert first is not None and Batch.of(first).group_ids == ["g1", "g2"]
    assert replay.counts["bad_batch_unknown_version"] == 1 and replay.exhausted
    assert replay.state().offsets == {"replay": 3}


def test_bare_sequences_make_a_batch_of_the_same_schema() -> None:
    record = sequences_batch([np.arange(5, dtype=np.int32)], [np.array([0, 0, 1, 1, 1], np.int8)])
    view = Batch.of(read_batch(record))
    assert view.sampled_tokens() == 3 and view.temperature.tolist() == [1.0] and view.advantage.tolist() == [0.0]


def position(n: int) -> FeedState:
    return FeedState({"t:0": n}, [("c", b"raw%d" % n)], [f"g{n}"], {n: float(n)})


def test_the_stream_resumes_after_what_the_learner_holds(tmp_path) -> None:
    log = FeedLog(tmp_path)
    assert log.resume(0) == log.resume(0)  # fresh: nothing acknowledged, nothing handed out
    log.prepare(1, position(1))
    log.ack(1, 1)
    log.prepare(2, position(2))  # batch 2 handed out, not acknowledged
    same = log.resume(1)  # the learner's checkpoint is version 1: batch 2 is trained again
    assert (same.seq, same.version, same.state) == (1, 1, position(1))
    log.prepare(2, position(2))
    ahead = log.resume(2)  # its checkpoint (version 2) holds batch 2: it died before the ack
    assert (ahead.seq, ahead.version, ahead.state) == (2, 2, position(2))
    assert log.resume(2).state == position(2)  # the promotion was written down
    log.prepare(3, position(3))
    by_seq = log.resume(acked_seq=3)  # out of process: the learner's acknowledgement names the batch
    assert by_seq.seq == 3 and by_seq.state == position(3)
    with pytest.raises(FeedStateError, match="older than its acknowledgements"):
        log.resume(1)
