"""The trainer's ranks through torchrun (``python -m streamrl.trainer.launch --standalone --nproc-per-node=N -m
streamrl.cli trainer ...``: torchrun's own arguments), ending quietly when stopped.

``streamrl up`` stops a part with SIGTERM to its process group. torchrun's agent then stops its ranks, as it
should, and re-raises the signal as a ``SignalException`` whose 30-line traceback ended every stop of a
multi-rank trainer. Here that stop is one line and exit status 0, as a one-rank trainer's graceful stop is; a
rank that fails still fails the launch (torchrun's ``ChildFailedError``, untouched)."""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main as torchrun


def main(argv: list[str] | None = None) -> int:
    try:
        torchrun(argv)
    except SignalException as exc:
        print(f"trainer ranks stopped ({exc.sigval.name})", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
