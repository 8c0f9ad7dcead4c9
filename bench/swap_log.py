"""Each version's swap as a gateway's log tells it (``gateway/hotswap.py``'s INFO lines), for the benches that
start gateways: publish -> served per version (exact; the metric's histogram gives only bucket bounds), the
adapter loads, and which versions waited for room under ``max_loaded_versions`` (an older version still running
requests): the one cause of a slow swap that the log names."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import learn_stats

SERVED = re.compile(rb"now served by (\S+) \(was .*?\), (\d+) ms after publication")
WAITED = re.compile(rb"(\S+) waits for an older version to drain")
LOADED = re.compile(rb"(\S+) loaded on .*?: received \d+ ms after publication, verified in \d+ ms, loaded in (\d+) ms")
VERSION = re.compile(r"@v(\d+)$")


def publish_to_served(log: Path, versions: Iterable[int] | None = None) -> dict[str, Any]:
    """The swaps of ``log`` (a gateway's log, or ``streamrl up``'s combined one), those of ``versions`` only when
    given: each version's publish -> served (ms, in the log's order), p50 / p99 / max, how many took over 500 ms,
    the versions that waited for room with their times, and the adapter loads' p50 / p99 (every replica's)."""
    try:
        text = log.read_bytes()
    except OSError:
        text = b""
    wanted = None if versions is None else set(versions)

    def kept(name: bytes) -> bool:
        m = VERSION.search(name.decode())
        return wanted is None or (m is not None and int(m.group(1)) in wanted)

    served = [(m.group(1), int(m.group(2))) for m in SERVED.finditer(text) if kept(m.group(1))]
    if not served:
        return {"versions": 0, "ms": []}
    waited = {m.group(1) for m in WAITED.finditer(text)}
    loads = [int(m.group(2)) for m in LOADED.finditer(text) if kept(m.group(1))]
    ms = [x for _, x in served]
    waited_ms = [x for name, x in served if name in waited]
    return {"versions": len(ms), "p50_ms": learn_stats.nearest_rank(ms, 0.5),
            "p99_ms": learn_stats.nearest_rank(ms, 0.99), "max_ms": max(ms),
            "over_500_ms": sum(x > 500 for x in ms), "ms": ms,
            "waited_for_room": len(waited_ms), "waited_ms": waited_ms,
            "over_500_ms_waited": sum(x > 500 for x in waited_ms),
            "adapter_load_p50_ms": learn_stats.nearest_rank(loads, 0.5),
            "adapter_load_p99_ms": learn_stats.nearest_rank(loads, 0.99)}
