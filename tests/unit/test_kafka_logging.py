"""kafka-python's slow-step warnings (``broker/kafka_logging.py``): short steps dropped, long ones and every other
warning of its network loop kept."""

from __future__ import annotations

import logging

import pytest

from streamrl.broker.kafka_logging import SlowNetworkStepFilter, quiet_slow_network_steps


def slow_step(seconds: float) -> str:  # kafka-python 3's own wording (kafka/net/selector.py)
    return (f"Task <kafka.net.selector.Task object at 0x7f24dc52da30> ran for {seconds:.3f}s (>0.100s threshold). "
            "It is blocking the event loop -- likely a tight sync loop inside a coroutine. Other pollers will time out.")


def test_short_slow_steps_are_dropped_and_long_ones_and_other_warnings_kept(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("kafka.net.selector")
    quiet_slow_network_steps()
    quiet_slow_network_steps()  # installed once
    assert sum(isinstance(f, SlowNetworkStepFilter) for f in logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger="kafka.net.selector"):
        logger.warning(slow_step(0.303))
        logger.warning(slow_step(1.5))
        logger.warning("Wakeup socket returned empty. Rebuilding.")
    assert [r.getMessage() for r in caplog.records] == [slow_step(1.5), "Wakeup socket returned empty. Rebuilding."]
