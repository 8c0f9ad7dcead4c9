"""bench/hotswap_bench.py's arithmetic: the chunk gaps around a swap, against the others."""

from __future__ import annotations

import pytest
from support.bench_module import load_bench


def test_chunk_gaps_split_at_the_routed_times() -> None:
    bench = load_bench("hotswap_bench")
    window = bench.AROUND_MOVE_S
    # one answer: chunks 10 ms apart, but one gap of 200 ms ending just after a version was routed at t = 10
    chunks = [9.0 + 0.01 * i for i in range(101)]  # 9.00 ... 10.00
    chunks.append(10.2)
    chunks += [10.2 + 0.01 * i for i in range(1, 11)]
    ok = bench.Sample(start=9.0, end=10.3, status=200, version=1, waited=0.0, chunks=chunks)
    failed = bench.Sample(start=9.0, end=9.5, status=0, version=-1, waited=0.0, chunks=[9.0, 9.9])  # not counted
    gaps = bench.chunk_gaps([ok, failed], routed_at=[10.0 - 1e-9])
    # the gap that ends at 10.00 and the ones after it, up to the window's end, are around the swap
    after = [c for c in chunks[1:] if 10.0 - 1e-9 <= c < 10.0 + window]
    assert gaps["chunk_gap_around_swap_n"] == len(after) and gaps["chunk_gap_steady_n"] == len(chunks) - 1 - len(after)
    assert gaps["chunk_gap_around_swap_max_ms"] == pytest.approx(200.0)
    assert gaps["chunk_gap_steady_max_ms"] == pytest.approx(10.0) and gaps["chunk_gap_steady_p50_ms"] == pytest.approx(10.0)
    assert bench.chunk_gaps([failed], routed_at=[10.0])["chunk_gap_steady_p50_ms"] is None
