"""A user's mistakes, told in one line before anything starts.

``UsageError`` is what a command raises for something its user can fix: a config file that does not parse,
a port already taken, a model that is neither a checkpoint nor a packaged name. ``streamrl``'s entry point
prints it as ``streamrl <command>: <message>`` on stderr and exits with code 2, without a traceback; a
Kafka that never answered (:func:`unreachable_kafka`) is one line too, exit code 1; anything else that escapes a
command is streamrl's own bug and keeps its traceback. The ``check_*``
functions are the checks a command makes of what it was given before it starts a process or binds a port,
so that a mistake costs seconds, not the minute it takes vLLM to start.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

EXIT_USAGE = 2
"""The exit code of a user's mistake (argparse's own, so that every such mistake reads alike)."""


class UsageError(ValueError):
    """Something the user gave that cannot work; the message says what, where and what to do. A
    ``ValueError``, so that code calling streamrl as a library catches it as it catches any refused value."""


EXIT_UNREACHABLE = 1
"""The exit code of a command that could not reach what it was pointed at (Kafka): not a mistake in the flags."""


def unreachable_kafka(exc: BaseException) -> str | None:
    """The one line a one-shot command (``publish``, ``export``) prints when Kafka did not answer at all, or None
    for any other error: kafka-python's clients raise ``KafkaTimeoutError("Unable to bootstrap from ...")`` when
    no broker answered within their bootstrap timeout (the daemons, gateway, trainer and judge, wait for Kafka
    instead)."""
    from kafka.errors import KafkaTimeoutError

    if isinstance(exc, KafkaTimeoutError) and "bootstrap" in str(exc):
        return (f"no Kafka broker answered ({exc}): check --bootstrap-servers (`streamrl up` logs its embedded "
                "broker's address as \"embedded broker ready at HOST:PORT\")")
    return None


@contextlib.contextmanager
def as_usage_error(where: str = "") -> Iterator[None]:
    """Turn the ``ValueError``/``TypeError`` a config dataclass raises on a bad value (and the
    ``FileNotFoundError`` of a file it names) into a ``UsageError`` (``where`` prefixes it, e.g.
    ``[trainer]``): while a configuration is being built, those are the user's values being refused."""
    try:
        yield
    except UsageError:
        raise
    except (ValueError, TypeError, FileNotFoundError) as exc:
        raise UsageError(f"{where}: {exc}" if where else str(exc)) from None


def check_port_free(host: str, port: int | None, what: str) -> None:
    """``port`` on ``host`` can be bound now (0 or None: a free one is picked later). ``what`` names the
    setting that gave it, for the message."""
    if not port:
        return
    if not 0 < port < 65536:
        raise UsageError(f"{what}: {port} is not a port number (1-65535, or 0 for a free one)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn and tansu bind: TIME_WAIT is fine
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise UsageError(f"{what}: port {port} on {host} is already in use by another process: "
                                 "stop it, or give a free port (0 picks one)") from None
            if exc.errno in (errno.EACCES, errno.EPERM):
                raise UsageError(f"{what}: not allowed to bind port {port} on {host} (ports below 1024 "
                                 "need privileges): give a port above 1023") from None
            raise UsageError(f"{what}: cannot bind {host}:{port}: {exc.strerror or exc}") from None


def check_url(url: str, what: str) -> None:
    """An ``http://`` or ``https://`` URL with a host (and a valid port when it names one)."""
    try:
        parts = urlsplit(url)
        port_ok = parts.port is None or parts.port > 0
    except ValueError as exc:
        raise UsageError(f"{what}: {url!r} is not a URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or not port_ok:
        raise UsageError(f"{what}: {url!r} is not an http:// or https:// URL with a host "
                         "(for example http://127.0.0.1:8000)")


def check_bootstrap_servers(servers: str, what: str = "bootstrap_servers") -> None:
    """Kafka's ``host:port[,host:port...]``."""
    for server in servers.split(","):
        host, _, port = server.strip().rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(f"{what}: {server.strip()!r} is not host:port (for example 127.0.0.1:9092; "
                             "several separated by commas)")


def check_file(path: str | Path, what: str) -> Path:
    """A file that exists and can be read."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise UsageError(f"{what}: {path} is a directory, not a file")
    if not p.exists():
        raise UsageError(f"{what}: no such file {path}")
    if not os.access(p, os.R_OK):
        raise UsageError(f"{what}: {path} cannot be read (permission denied)")
    return p


def check_dir(path: str | Path, what: str) -> Path:
    """A directory that exists and can be read."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise UsageError(f"{what}: {path} is a file, not a directory")
    if not p.exists():
        raise UsageError(f"{what}: no such directory {path}")
    if not os.access(p, os.R_OK | os.X_OK):
        raise UsageError(f"{what}: {path} cannot be read (permission denied)")
    return p


def check_writable_dir(path: str | Path, what: str) -> None:
    """``path`` is, or can be made, a directory this process writes into (its nearest existing ancestor
    is a writable directory)."""
    p = Path(path).expanduser().absolute()
    existing = next((a for a in (p, *p.parents) if a.exists()), Path("/"))
    if not existing.is_dir():
        raise UsageError(f"{what}: {existing} is a file, so {path} cannot be a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{what}: {existing} is not writable, so {path} cannot be written")


def check_model(model: str, what: str = "--model") -> None:
    """A checkpoint directory (with its ``config.json``), a model ``streamrl model --list`` knows, or a
    hub id already in the local Hugging Face cache (no hub is asked: the machines may have none)."""
    from streamrl.packaged_models import MODELS

    if model in MODELS:
        return
    p = Path(model).expanduser()
    known = ", ".join(sorted(MODELS))
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise UsageError(f"{what}: {model} is a directory but not a model checkpoint (it has no config.json): "
                             "give a Hugging Face checkpoint directory, or one of the packaged models "
                             f"({known}; see streamrl model --list)")
        return
    if p.exists():
        raise UsageError(f"{what}: {model} is a file; give a checkpoint directory or a packaged model name "
                         f"({known})")
    if _in_hub_cache(model):
        return
    raise UsageError(f"{what}: {model!r} is neither a checkpoint directory nor a model streamrl knows: give a "
                     f"directory holding a Hugging Face checkpoint (config.json and weights), or one of "
                     f"{known} (streamrl model --list)")


def _in_hub_cache(model: str) -> bool:
    """``org/name`` whose ``config.json`` the local Hugging Face cache already holds."""
    if model.count("/") != 1 or model.startswith(("/", ".", "~")):
        return False
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(model, "config.json"), str)
    except Exception:  # not a valid repo id, or no hub library: not in the cache
        return False
