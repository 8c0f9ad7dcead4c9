"""The spool's file format and bookkeeping: order, restart, torn tail, corrupt frames, bounds, cleanup."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamrl.gateway.recording.spool import HEAD, SUFFIX, Spool, SpoolFull, SpoolRecord, encode_frame


def _records(n: int, tag: str = "r", size: int = 100, keyless: bool = True) -> list[SpoolRecord]:
    """Records of one size, but every fifth without a key (``keyless``), which makes it shorter."""
    return [SpoolRecord(f"topic-{i % 3}", None if keyless and i % 5 == 0 else f"{tag}-{i:04d}".encode(),
                        f"{tag}-{i:04d}|".encode() + bytes([i % 256]) * size, 1_700_000_000_000 + i)
            for i in range(n)]


def _start(recs: list[SpoolRecord], i: int) -> int:
    """Where the ``i``-th record's frame starts in a segment holding ``recs``."""
    return sum(len(encode_frame(r)) for r in recs[:i])


def _drain(spool: Spool, batch: int = 7) -> list[SpoolRecord]:
    """Read everything in batches, committing each."""
    out: list[SpoolRecord] = []
    while True:
        got, pos = spool.read(max_records=batch)
        if not got:
            return out
        out += got
        spool.commit(pos, len(got))


def _segments(d: Path) -> list[Path]:
    return sorted(d.glob(f"*{SUFFIX}"))


def test_replays_in_order_across_segments_and_deletes_delivered_segments(tmp_path: Path) -> None:
    spool = Spool(tmp_path, segment_bytes=2_000)
    recs = _records(100)
    for i in range(0, 100, 10):
        spool.append(recs[i:i + 10])
    assert spool.records == 100 and len(_segments(tmp_path)) > 3
    assert _drain(spool) == recs
    assert spool.empty and spool.records == 0
    assert len(_segments(tmp_path)) <= 2 and spool.bytes <= 2_000 + 2 * len(encode_frame(recs[0]))
    spool.append(recs[:3])  # appends after a full drain are read too
    assert _drain(spool) == recs[:3]
    spool.close()


def test_restart_replays_from_the_persisted_cursor(tmp_path: Path) -> None:
    recs = _records(50)
    spool = Spool(tmp_path, segment_bytes=1_500)
    spool.append(recs[:30])
    got, pos = spool.read(max_records=12)
    spool.commit(pos, len(got))
    got2, _ = spool.read(max_records=5)  # read, not committed: delivered again after a restart
    assert got + got2 == recs[:17]
    spool.append(recs[30:])
    spool.close()  # (a kill -9 leaves the same files: appends are single writes, the cursor a rename)
    again = Spool(tmp_path, segment_bytes=1_500)
    assert again.records == 38 and again.corrupt == 0
    assert _drain(again) == recs[12:]
    again.close()


def test_one_process_per_spool_directory(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    with pytest.raises(RuntimeError, match="in use"):
        Spool(tmp_path)
    spool.close()
    Spool(tmp_path).close()


def test_torn_tail_is_cut_and_appends_continue(tmp_path: Path) -> None:
    recs = _records(10)
    spool = Spool(tmp_path)
    spool.append(recs[:9])
    spool.close()
    seg = _segments(tmp_path)[-1]
    whole = seg.stat().st_size
    with open(seg, "ab") as f:  # a crash in the middle of writing the 10th frame
        f.write(encode_frame(recs[9])[:HEAD.size + 20])
    again = Spool(tmp_path)
    assert again.torn_bytes == HEAD.size + 20 and seg.stat().st_size == whole
    assert again.records == 9 and again.corrupt == 0
    again.append(recs[9:])
    assert _drain(again) == recs
    again.close()


def test_bad_checksum_is_counted_and_skipped(tmp_path: Path) -> None:
    recs = _records(10)
    spool = Spool(tmp_path)
    spool.append(recs)
    spool.close()
    seg = _segments(tmp_path)[-1]
    data = bytearray(seg.read_bytes())
    data[_start(recs, 4) + HEAD.size + 30] ^= 0xFF  # a flipped bit in the value of the 5th record
    seg.write_bytes(bytes(data))
    again = Spool(tmp_path)
    assert again.corrupt == 1 and again.records == 9 and again.torn_bytes == 0
    assert _drain(again) == recs[:4] + recs[5:]
    again.close()


def test_corrupt_length_resynchronises_on_the_next_frame(tmp_path: Path) -> None:
    recs = _records(6)
    spool = Spool(tmp_path)
    spool.append(recs)
    spool.close()
    seg = _segments(tmp_path)[-1]
    data = bytearray(seg.read_bytes())
    data[_start(recs, 2) + 2:_start(recs, 2) + 6] = (10 << 20).to_bytes(4, "little")  # 3rd frame claims 10 MB
    seg.write_bytes(bytes(data))
    again = Spool(tmp_path)
    assert again.corrupt == 1 and again.records == 5
    assert _drain(again) == recs[:2] + recs[3:]
    again.close()


def test_bound_in_bytes_refuses_whole_appends_and_room_comes_back(tmp_path: Path) -> None:
    recs = _records(12, keyless=False)
    frame = len(encode_frame(recs[0]))
    spool = Spool(tmp_path, max_bytes=10 * frame, segment_bytes=3 * frame)
    for r in recs[:8]:  # one append goes into one segment: one at a time, so that segments hold 3 each
        spool.append([r])
    with pytest.raises(SpoolFull):
        spool.append(recs[8:11])  # 3 more would pass the bound: none is appended
    assert spool.full and spool.records == 8 and spool.bytes == 8 * frame
    spool.append(recs[8:9])
    spool.append(recs[9:10])
    assert spool.records == 10 and spool.bytes == 10 * frame
    with pytest.raises(SpoolFull):
        spool.append(recs[10:11])
    got, pos = spool.read(max_records=6)  # delivering frees whole segments
    spool.commit(pos, len(got))
    assert spool.bytes == 4 * frame  # the two segments of records 0-5 are gone
    spool.append(recs[10:12])
    assert not spool.full
    assert got + _drain(spool) == recs
    spool.close()


def test_fsynced_append_and_read_bounds(tmp_path: Path) -> None:
    spool = Spool(tmp_path)
    big = SpoolRecord("t", b"k", b"x" * 100_000, 1)
    spool.append([big] * 5, sync=True)
    got, _ = spool.read(max_records=100, max_bytes=250_000)
    assert len(got) in (2, 3) and got[0] == big
    got2, _ = spool.read(max_records=100, max_bytes=1)  # at least one record however small the bound
    assert len(got2) == 1
    spool.close()
