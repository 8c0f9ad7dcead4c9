"""What an upstream's capture probe says against what the gateway needs (``gateway/upstreams.py``).

Its LoRA slots against the policies' (``lora_check``, ``lora_warning``; ``engine/lora_slots.py``): too few is one
warning naming the upstream, its slots, those needed and the flags to set, a ``/health`` field and a metric; the
upstream stays in rotation. An engine whose probe does not say is ``unknown``, without a warning. In the
``in-flight`` update mode, an upstream that cannot move running requests is one warning saying why (its requests
run pinned) and ``moves_requests: false`` in ``/health``."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from streamrl.engine.lora_slots import lora_slots
from streamrl.engine.wire import FORMAT_VERSION, PROBE_PATH, SPANS_FORMAT_VERSION
from streamrl.gateway.metrics import GatewayMetrics
from streamrl.gateway.upstreams import NOT_REPORTED, UpstreamPool, lora_check, lora_warning

SLOTS = {"max_loras": 6, "max_cpu_loras": 8, "max_lora_rank": 16}
"""What the test engine (``tests/support/services.py``) reports."""


def test_enough_slots_are_ok_and_either_count_short_is_too_few() -> None:
    assert lora_slots(1, 3) == (3, 3) and lora_slots(2, 3) == (6, 6) and lora_slots(3, 3) == (9, 9)
    assert lora_check(SLOTS, lora_slots(2, 3)) == {"status": "ok", **SLOTS, "needs": {"max_loras": 6,
                                                                                       "max_cpu_loras": 6}}
    assert lora_check({**SLOTS, "max_cpu_loras": 6}, lora_slots(1, 6))["status"] == "ok"  # exactly: (6, 6)
    assert lora_check({**SLOTS, "max_loras": 9}, lora_slots(1, 9))["status"] == "too_few"  # CPU short only
    assert lora_check({**SLOTS, "max_loras": 5}, lora_slots(2, 3))["status"] == "too_few"  # GPU short only
    assert lora_check(None, (2, 3)) == {"status": "off", "needs": {"max_loras": 2, "max_cpu_loras": 3}}
    for unreported in (NOT_REPORTED, {"max_loras": 4}, {**SLOTS, "max_loras": "4"}, {**SLOTS, "max_loras": True},
                       "yes"):
        assert lora_check(unreported, (2, 3))["status"] == "unknown", unreported


def test_the_warning_names_what_it_has_what_it_needs_and_the_flags() -> None:
    state = lora_check({**SLOTS, "max_cpu_loras": 4}, lora_slots(3, 3))
    text = lora_warning("http://gpu-7:8000", state, 3, 3)
    assert text is not None
    assert text.startswith("upstream http://gpu-7:8000 has too few LoRA slots for this gateway's 3 policies x "
                           "max_loaded_versions 3: --max-loras 6 (needs 9), --max-cpu-loras 4 (needs 9).")
    assert "evict each other" in text and "wait in the engine until an older version's last reply ends" in text
    assert text.endswith("Restart it with --max-loras 9 --max-cpu-loras 9, or lower max_loaded_versions")
    only_cpu = lora_warning("http://u", lora_check({**SLOTS, "max_loras": 9}, lora_slots(1, 9)), 1, 9)
    assert only_cpu is not None and "--max-loras 9, --max-cpu-loras 8 (needs 9)" in only_cpu  # 9 GPU slots: enough
    assert "1 policy x" in only_cpu
    off = lora_warning("http://u", lora_check(None, (2, 3)), 1, 3)
    assert off is not None and "LoRA off" in off and "--enable-lora --max-loras 2 --max-cpu-loras 3" in off
    assert lora_warning("http://u", lora_check(SLOTS, (2, 3)), 1, 3) is None
    assert lora_warning("http://u", lora_check(NOT_REPORTED, (2, 3)), 1, 3) is None


async def probe_rounds(probe: dict[str, Any] | None, *, policies: int, rounds: int = 1,
                       token_capture: bool = True, in_flight: bool = False) -> tuple[UpstreamPool, list[str]]:
    """A pool of ``policies`` policies in front of a fake upstream whose capture probe answers ``probe`` (None: a
    404, as a plain vLLM): it joins, then leaves and joins again ``rounds - 1`` times; the pool and what
    ``/metrics`` says of the upstream's slots."""
    async def health(_: web.Request) -> web.Response:
        return web.Response()

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "base"}]})

    async def capture_probe(_: web.Request) -> web.Response:
        return web.json_response(probe) if probe is not None else web.json_response({"error": {}}, status=404)

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get(PROBE_PATH, capture_probe)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    pool = UpstreamPool((f"http://127.0.0.1:{port}",), interval_s=3600, policies=policies, max_loaded_versions=3,
                        token_capture=token_capture, in_flight=in_flight)
    try:
        async with aiohttp.ClientSession() as session:
            await pool.start(session)
            for _ in range(rounds - 1):
                pool.mark_failed(pool.upstreams[0], "a restart")
                await pool.check_all()
            await pool.stop()
    finally:
        await runner.cleanup()
    metrics = GatewayMetrics()
    metrics.watch(pool, lambda: None, lambda: 0, dict, lambda: None)
    gauges = [line for line in metrics.render().decode().splitlines() if line.startswith("streamrl_gateway_upstream_lora")]
    return pool, gauges


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "LoRA" in r.getMessage()]


def test_an_upstream_with_too_few_slots_serves_on_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "streamrl.gateway.upstreams")
    probe = {"format": FORMAT_VERSION, "deferred": False, "lora": SLOTS}
    pool, gauges = asyncio.run(probe_rounds(probe, policies=3, rounds=3))
    up = pool.upstreams[0]
    assert up.healthy and up.token_capture, "too few slots is no reason to leave it out of rotation"
    assert up.state()["lora"] == {"status": "too_few", **SLOTS, "needs": {"max_loras": 9, "max_cpu_loras": 9}}
    [warning] = warnings(caplog)  # joined three times with the same slots: said once
    assert f"upstream {up.url} has too few LoRA slots" in warning and "--max-loras 6 (needs 9)" in warning
    assert gauges == [f'streamrl_gateway_upstream_lora_slots_short{{upstream="{up.url}"}} 1.0']
    assert any("LoRA slots 6 GPU, 8 CPU, rank 16, too_few" in r.getMessage() for r in caplog.records)


def test_enough_slots_are_quiet_and_exported_as_zero(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "streamrl.gateway.upstreams")
    pool, gauges = asyncio.run(probe_rounds({"format": FORMAT_VERSION, "lora": SLOTS}, policies=2))
    assert pool.upstreams[0].lora["status"] == "ok" and warnings(caplog) == []
    assert gauges == [f'streamrl_gateway_upstream_lora_slots_short{{upstream="{pool.upstreams[0].url}"}} 0.0']


@pytest.mark.parametrize("probe", [{"format": FORMAT_VERSION, "deferred": True}, None],
                         ids=["older engine", "plain vLLM"])
def test_an_engine_that_does_not_say_is_unknown_without_a_warning(probe: dict[str, Any] | None,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "streamrl.gateway.upstreams")
    pool, gauges = asyncio.run(probe_rounds(probe, policies=8, rounds=2))
    up = pool.upstreams[0]
    assert up.healthy and up.token_capture == (probe is not None)
    assert up.state()["lora"] == {"status": "unknown", "needs": {"max_loras": 24, "max_cpu_loras": 24}}
    assert warnings(caplog) == [] and gauges == []


def test_lora_off_is_a_warning_and_the_probe_is_read_with_token_capture_off(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "streamrl.gateway.upstreams")
    pool, gauges = asyncio.run(probe_rounds({"format": FORMAT_VERSION, "lora": None}, policies=1,
                                            token_capture=False))
    up = pool.upstreams[0]
    assert up.healthy and up.token_capture is False and up.lora["status"] == "off"
    [warning] = warnings(caplog)
    assert "has LoRA off" in warning and gauges[0].endswith(" 1.0")


def test_before_its_probe_an_upstream_says_unknown_with_what_it_needs() -> None:
    pool = UpstreamPool(("http://127.0.0.1:9",), policies=2, max_loaded_versions=4)
    assert pool.upstreams[0].state()["lora"] == {"status": "unknown", "needs": {"max_loras": 8, "max_cpu_loras": 8}}


def pinned_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
            and "cannot move running requests" in r.getMessage()]


MOVES = {"format": FORMAT_VERSION, "formats": [FORMAT_VERSION, SPANS_FORMAT_VERSION], "lora": SLOTS}
"""The probe of this release's ``streamrl engine``: capture frames with version spans."""


@pytest.mark.parametrize(("probe", "why"), [
    (None, "(no capture probe: a plain vLLM)"),
    ({"format": FORMAT_VERSION - 1, "lora": SLOTS}, f"(its capture is format {FORMAT_VERSION - 1}, not this gateway's"),
    ({"format": FORMAT_VERSION, "formats": [FORMAT_VERSION], "lora": SLOTS},
     f"(its capture lists formats [{FORMAT_VERSION}], without {SPANS_FORMAT_VERSION}, which says which version"),
], ids=["plain vLLM", "older capture", "capture without spans"])
def test_in_flight_an_upstream_that_cannot_move_requests_is_one_warning(probe: dict[str, Any] | None, why: str,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "streamrl.gateway.upstreams")
    pool, _ = asyncio.run(probe_rounds(probe, policies=1, rounds=3, in_flight=True))
    up = pool.upstreams[0]
    assert up.healthy and up.state()["moves_requests"] is False
    [warning] = pinned_warnings(caplog)  # joined three times: said once
    assert warning.startswith(f"upstream {up.url} cannot move running requests to a newer version {why}")
    assert "its requests run pinned" in warning


def test_an_engine_that_moves_requests_and_the_pinned_mode_are_quiet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "streamrl.gateway.upstreams")
    pool, _ = asyncio.run(probe_rounds(MOVES, policies=1, in_flight=True))
    assert pool.upstreams[0].state()["moves_requests"] is True and "in_flight_moves" in pool.upstreams[0].state()
    pinned, _ = asyncio.run(probe_rounds(None, policies=1))  # pinned: a plain vLLM loses nothing by not moving
    assert pinned.upstreams[0].state()["moves_requests"] is False and pinned_warnings(caplog) == []
