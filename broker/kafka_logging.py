"""What kafka-python logs, made to speak only when it matters (no import of kafka here: the CLI installs this
before it knows whether its command uses Kafka at all)."""

from __future__ import annotations

import logging
import re


class SlowNetworkStepFilter(logging.Filter):
    """kafka-python 3 warns whenever one step of its network loop took over 100 ms ("It is blocking the event
    loop -- likely a tight sync loop inside a coroutine"). In streamrl's processes such a step is nearly always
    another thread holding the interpreter a moment (a trainer's torch step, a gateway's relay, the judge's
    parsing), not a fault of the client: a dozen of these lines in a quiet run read as an alarm. Steps shorter
    than ``seconds`` are dropped; longer ones, which can make a client miss its deadlines, still warn."""

    _RAN_FOR = re.compile(r" ran for ([0-9.]+)s \(")

    def __init__(self, seconds: float = 1.0) -> None:
        super().__init__()
        self.seconds = seconds

    def filter(self, record: logging.LogRecord) -> bool:
        found = self._RAN_FOR.search(record.getMessage())
        return found is None or float(found.group(1)) >= self.seconds


def quiet_slow_network_steps(seconds: float = 1.0) -> None:
    """Install ``SlowNetworkStepFilter`` on kafka-python's network loop logger (once per process)."""
    logger = logging.getLogger("kafka.net.selector")
    if not any(isinstance(f, SlowNetworkStepFilter) for f in logger.filters):
        logger.addFilter(SlowNetworkStepFilter(seconds))
