"""bench/swap_log.py: each version's swap read from a gateway's log lines, as gateway/hotswap.py writes them."""

from __future__ import annotations

from pathlib import Path

from support.bench_module import load_bench

H = "gateway | 2026-12-06 05:08:59,471 INFO streamrl.gateway.hotswap:"


def write_log(path: Path) -> Path:
    path.write_text("\n".join([
        f"{H} p@v1 loaded on http://127.0.0.1:8000: received 3 ms after publication, verified in 12 ms, loaded in 40 ms",
        f"{H} policy 'p' now served by p@v1 (was the base model), 80 ms after publication",
        f"{H} p@v2 waits for an older version to drain (3 loaded)",
        f"{H} p@v2 waits for an older version to drain (3 loaded)",  # woken, still no room: one version
        f"{H} p@v2 loaded on http://127.0.0.1:8000: received 2 ms after publication, verified in 9 ms, loaded in 55 ms",
        f"{H} policy 'p' now served by p@v2 (was p@v1), 1398 ms after publication",
        f"{H} p@v3 waits for an older version to drain (3 loaded)",
        f"{H} policy 'p' now served by p@v3 (was p@v2), 301 ms after publication",
        f"{H} policy 'p' now served by p@v4 (was p@v3), 90 ms after publication",
    ]) + "\n")
    return path


def test_each_version_is_read_and_those_that_waited_for_room_are_named(tmp_path: Path) -> None:
    swap_log = load_bench("swap_log")
    got = swap_log.publish_to_served(write_log(tmp_path / "up.log"))
    assert got["ms"] == [80, 1398, 301, 90] and got["max_ms"] == 1398 and got["over_500_ms"] == 1
    assert got["p50_ms"] == 90 and got["p99_ms"] == 1398
    assert got["waited_for_room"] == 2 and got["waited_ms"] == [1398, 301] and got["over_500_ms_waited"] == 1
    assert got["adapter_load_p50_ms"] == 40 and got["adapter_load_p99_ms"] == 55
    assert swap_log.publish_to_served(tmp_path / "absent.log") == {"versions": 0, "ms": []}


def test_only_the_versions_asked_for_count(tmp_path: Path) -> None:
    """A bench that runs several modes on one log's numbering takes each mode's own versions."""
    swap_log = load_bench("swap_log")
    got = swap_log.publish_to_served(write_log(tmp_path / "gateway.log"), versions=range(2, 4))
    assert got["ms"] == [1398, 301] and got["waited_for_room"] == 2
    assert got["adapter_load_p50_ms"] == 55
    assert swap_log.publish_to_served(tmp_path / "gateway.log", versions=[9]) == {"versions": 0, "ms": []}
