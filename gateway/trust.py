"""What a policy record must pass before its adapter is loaded into an upstream.

The policy topic tells every gateway which files to load into its engines, so a record is checked, not
believed: its publisher must be trusted (``GatewayConfig.trusted_publishers``, when set), its adapter
directory and every file in it must resolve, symlinks followed, inside ``adapter_root`` (when set), and
its weights file must hash to the record's sha256. The publisher is what the record claims: the topic's
write access (Kafka ACLs, ``infra/``) is what makes the claim hold; the check keeps out the versions of
another trainer sharing the topic by mistake and says so. The checks run where the gateway hands the path
on, just before the load; a directory changed between the check and vLLM reading it is outside what
this can see (keep ``adapter_root`` writable by the trainer alone).
"""

from __future__ import annotations

from pathlib import Path

from streamrl.broker.schema import WEIGHTS_FILE, PolicyRecord, sha256_file


class PolicyRejected(Exception):
    """A record not to serve; ``reason`` labels the metric (``metrics.REJECT_REASONS``)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def check_publisher(record: PolicyRecord, trusted: tuple[str, ...]) -> None:
    if trusted and record.publisher not in trusted:
        raise PolicyRejected("publisher", f"published by {record.publisher or 'an unnamed publisher'}, "
                                          f"not one of the trusted publishers ({', '.join(trusted)})")


def check_inside(directory: Path, root: str) -> None:
    """The directory and each entry of it resolve under ``root`` (a symlink pointing out counts as out)."""
    base = Path(root).resolve()
    if not directory.is_absolute():
        raise PolicyRejected("outside_root", f"adapter path {directory} is not absolute")
    for path in (directory, *(directory.iterdir() if directory.is_dir() else ())):
        if not path.resolve().is_relative_to(base):
            raise PolicyRejected("outside_root", f"{path} resolves to {path.resolve()}, outside the adapter "
                                                 f"root {base}")


def check_adapter(record: PolicyRecord, adapter_root: str | None) -> None:
    """Root first (nothing outside it is read), then the weights' sha256. Blocking: run it in a thread."""
    directory = Path(record.path)
    if adapter_root is not None:
        check_inside(directory, adapter_root)
    weights = directory / WEIGHTS_FILE
    try:
        digest = sha256_file(weights)
    except OSError as exc:
        raise PolicyRejected("sha256", f"{weights} is unreadable ({exc.strerror or exc})") from None
    if digest != record.sha256:
        raise PolicyRejected("sha256", f"sha256 of {weights} is {digest}, the record says {record.sha256}")
