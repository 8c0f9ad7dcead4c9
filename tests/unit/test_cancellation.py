"""The gateway's loops wait for an event with a timeout and are stopped by cancellation. On Python 3.11,
``asyncio.wait_for`` returns normally when the cancellation arrives as the event fires (CPython gh-86296),
so such a loop ran on after its cancellation and held a stopping gateway for ever. The loops use
``asyncio.timeout`` instead (and ruff bans ``asyncio.wait_for``, pyproject.toml)."""

from __future__ import annotations

import asyncio
import contextlib
import sys

import pytest


async def race(wait) -> bool:
    """A loop waiting on an event through ``wait``; the event fires and the loop is cancelled in the same
    step of the event loop. True when the loop ended with its cancellation. A loop that loses it waits once
    more, times out after 50 ms and ends by itself, so the test ends either way."""
    event = asyncio.Event()
    rounds = 0

    async def loop() -> None:
        nonlocal rounds
        while rounds < 2:
            with contextlib.suppress(TimeoutError):
                await wait(event, 0.05)
            event.clear()
            rounds += 1

    task = asyncio.create_task(loop())
    await asyncio.sleep(0)  # the loop waits
    event.set()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return task.cancelled() and rounds == 0


async def timed(event: asyncio.Event, timeout_s: float) -> None:
    async with asyncio.timeout(timeout_s):
        await event.wait()


async def wait_for(event: asyncio.Event, timeout_s: float) -> None:
    await asyncio.wait_for(event.wait(), timeout_s)  # noqa: TID251 (what this test shows to be wrong)


def test_a_timed_wait_ends_with_its_cancellation() -> None:
    assert asyncio.run(race(timed))


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="wait_for keeps the cancellation from 3.12 on")
def test_wait_for_loses_the_cancellation_on_this_python() -> None:
    """Why the ban: the same loop through ``wait_for`` is not cancelled."""
    assert not asyncio.run(race(wait_for))
