"""What every benchmark records beside its figures, so that a result file says where it came from: the machine
(CPU, cores, Python, GPUs), the code (commit), the command and when. ``stamp()`` at the top of each result.

The commit is ``git``'s where the bench runs in a checkout; a copy without ``.git`` (the GPU machines get
``git archive``, docs/gpu.md) carries it in a ``COMMIT`` file at its root; else ``unknown``. Uncommitted changes
to tracked files are marked (``+changes``): a figure from them cannot be checked out again.
"""

from __future__ import annotations

import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def gpus() -> list[str]:
    """The GPUs' names as ``nvidia-smi`` lists them (none where there is no NVIDIA GPU)."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def machine() -> str:
    """One line: ``x86_64, 16 cores, Python 3.12.3, 1 x NVIDIA H100 80GB HBM3``."""
    parts = [platform.machine(), f"{os.cpu_count()} cores", f"Python {platform.python_version()}"]
    names = gpus()
    if names:
        parts.append(", ".join(f"{names.count(n)} x {n}" for n in dict.fromkeys(names)))
    return ", ".join(parts)


def commit(root: Path = ROOT) -> str:
    """The measured code's commit (short), ``+changes`` if tracked files differ from it. A copy made with ``git
    archive`` (docs/gpu.md) says its commit in a ``COMMIT`` file, which wins: such a copy may sit inside another
    checkout, whose git would answer for the wrong tree."""
    stamped = root / "COMMIT"
    if stamped.is_file():
        return stamped.read_text().strip()
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
        return head + ("+changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def stamp() -> dict[str, str]:
    """``machine``, ``commit``, ``command`` and ``date`` (UTC) of this run, for the top of its result file."""
    return {"machine": machine(), "commit": commit(),
            "command": shlex.join([Path(sys.executable).name, *sys.argv]),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
