"""What `streamrl up` shows and hears: its parts' output, prefixed, on one console (each part's whole log in a
file of its own), and Ctrl-C / SIGTERM turned into an orderly stop."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

_CLIENT_CHATTER = re.compile(r" (?:DEBUG|INFO) (?:kafka|httpx|aiohttp|urllib3)[.:]")
_ENGINE_TROUBLE = re.compile(r"ERROR|CRITICAL|Traceback|Error\b|Exception")


def console_worthy(part: str, text: str, verbose: bool) -> bool:
    """What reaches the console (every line still goes to the part's log file): not the Kafka/HTTP
    clients' INFO chatter, and of vLLM only its trouble unless ``verbose``."""
    if verbose:
        return True
    if part == "engine" or part.startswith("engine-"):
        return bool(_ENGINE_TROUBLE.search(text))
    return not _CLIENT_CHATTER.search(text)


class CombinedLog:
    """Prefixes each part's lines with its name on stdout, and keeps each part's full log in a file."""

    def __init__(self, out: IO[str] | None = None, verbose: bool = False) -> None:
        self.out = out or sys.stdout
        self.verbose = verbose
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def line(self, part: str, text: str) -> None:
        with self.lock:
            self.out.write(f"{part:<8}| {text.rstrip()}\n")
            self.out.flush()

    def pump(self, part: str, stream: IO[bytes], log_file: Path) -> None:
        """Copy a child's output to its log file and, prefixed, to the console."""
        def run() -> None:
            with open(log_file, "ab") as f:
                for raw in iter(stream.readline, b""):
                    f.write(raw)
                    f.flush()
                    text = raw.decode(errors="replace")
                    if console_worthy(part, text, self.verbose):
                        self.line(part, text)
        self._start(run)

    def follow(self, part: str, log_file: Path, stop: threading.Event) -> None:
        """Follow a log file another component writes (the engine's)."""
        def run() -> None:
            log_file.touch()
            with open(log_file, errors="replace") as f:
                f.seek(0, os.SEEK_END)
                while not stop.is_set():
                    text = f.readline()
                    if not text:
                        time.sleep(0.2)
                    elif console_worthy(part, text, self.verbose):
                        self.line(part, text)
        self._start(run)

    def _start(self, target: Any) -> None:
        t = threading.Thread(target=target, daemon=True)
        t.start()
        self.threads.append(t)



class Shutdown(Exception):
    """Raised in the main thread when SIGINT/SIGTERM arrives (outside a spawn)."""


class SignalGate:
    """Turns SIGINT/SIGTERM into ``Shutdown`` in the main thread, except while a child is being spawned:
    then the signal waits until the child is tracked, so a shutdown never leaves one behind. (Blocking
    the signals with a mask instead would be inherited by the children, which then ignore SIGTERM.)"""

    def __init__(self) -> None:
        self.pending: str | None = None
        self.deferring = 0

    def handler(self, signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        if self.deferring:
            self.pending = name
        else:
            raise Shutdown(name)

    @contextlib.contextmanager
    def defer(self) -> Iterator[None]:
        self.deferring += 1
        try:
            yield
        finally:
            self.deferring -= 1
        if self.pending and not self.deferring:
            raise Shutdown(self.pending)

