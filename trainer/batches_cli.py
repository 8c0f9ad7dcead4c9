"""`streamrl batches --to DIR|-`: the batch stream for a learner in another process or language, as Arrow IPC.

Each step's batch is written as ``DIR/<seq>.arrow`` (an IPC file, renamed into place whole) or, with
``--to -``, as the next message of one IPC stream on stdout (its sequence number in the message's custom
metadata). The learner acknowledges after its checkpoint of version ``V`` holding batch ``N`` is durable,
either by renaming ``{"seq": N, "version": V}`` into the ack file (``DIR/ack.json``, or ``--ack FILE``) or,
with ``--ack-port``, by ``POST /ack`` (``batches_ack.py``: the stream then writes that same file); the next
batch follows the acknowledgement. The batch handed out last is kept in the stream's state directory until
it is acknowledged, so a restarted ``streamrl batches`` hands out that same batch again: whichever side is
killed, every group is trained once. docs/trainer.md, "Out of process".
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from streamrl.config_flags import add_config_flags, given
from streamrl.usage import UsageError, as_usage_error, check_bootstrap_servers, check_dir, check_port_free

from .batches_ack import FileAcks, HttpAcks
from .config import TrainerConfig

if TYPE_CHECKING:
    import pyarrow as pa

log = logging.getLogger("streamrl.batches")

DESCRIPTION = """\
The trainer's batch stream for a learner of your own in another process: each step's Arrow batch (the
schema of docs/trainer.md) as an IPC file per step in DIR, or one IPC stream on stdout; the learner
acknowledges each batch after its checkpoint by writing {"seq": N, "version": V} to the ack file, or,
with --ack-port, by POST /ack {"seq": N, "adapter_version": V} on 127.0.0.1.

  streamrl batches --to ./steps --bootstrap-servers HOST:9092 --state-dir ./stream-state
  streamrl batches --to - --ack ./ack.json --bootstrap-servers HOST:9092 --state-dir ./stream-state | learner
  streamrl batches --to ./steps --ack-port 8377 --bootstrap-servers HOST:9092 --state-dir ./stream-state

Docs: docs/trainer.md, "Bring your own learner"."""

FEED_FIELDS = ("bootstrap_servers", "topic_prefix", "kafka", "key_ids", "consumer_group", "state_dir", "adapters",
               "name", "replay", "group_size", "groups_per_step", "group_timeout_s", "trajectory_ttl_s",
               "max_pending_trajectories", "max_lag", "max_ready_groups", "backlog", "max_step_tokens",
               "advantage_std_norm", "poll_timeout_s", "max_steps")
"""The TrainerConfig settings (flat names) that choose the batches (``max_steps``: stop after this many acknowledged)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--to", required=True, metavar="DIR|-", help="directory for one IPC file per step, or - for stdout")
    p.add_argument("--ack", type=Path, help="the acknowledgement file (default DIR/ack.json; with --to -, required "
                                             "unless --ack-port is given, then default <state-dir>/ack.json)")
    p.add_argument("--ack-port", type=int, metavar="PORT",
                   help="take acknowledgements as POST /ack on this port (0: a free one, logged) instead of the "
                        "learner writing the ack file; the stream writes it")
    p.add_argument("--ack-host", default="127.0.0.1", help="the address --ack-port listens on (default 127.0.0.1)")
    p.add_argument("--config", help="TOML or JSON file of TrainerConfig fields (flags override it)")
    add_config_flags(p, TrainerConfig, only=FEED_FIELDS, names={"group_timeout_s": "group-timeout"})


class Sink:
    """Where batches go: files in a directory, or one IPC stream on stdout."""

    def __init__(self, to: str) -> None:
        from .batch_io import IpcStreamWriter

        self.directory = None if to == "-" else Path(to)
        self.stream = IpcStreamWriter(sys.stdout.buffer) if self.directory is None else None

    def emit(self, record) -> None:
        from .batch import batch_seq
        from .batch_io import write_ipc_file

        if self.directory is not None:
            write_ipc_file(record, self.directory / f"{batch_seq(record):010d}.arrow")
        else:
            assert self.stream is not None
            self.stream.write(record)

    def acknowledged(self, seq: int) -> None:
        """Files of acknowledged batches are the learner's now: removed (the newest one stays)."""
        if self.directory is not None:
            for p in self.directory.glob("*.arrow"):
                if p.stem.isdigit() and int(p.stem) < seq:
                    p.unlink(missing_ok=True)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()


def serve(config: TrainerConfig, to: str, acks: FileAcks, stop: threading.Event) -> int:
    """Hand out batches until ``stop``, ``max_steps`` acknowledged or the end of a replay; returns batches
    acknowledged. ``acks`` is how the learner acknowledges (a file, or HTTP writing that file)."""
    from .batch import batch_seq
    from .batch_io import read_ipc_file, write_ipc_file
    from .stream import BatchStream

    outstanding_path = config.state_path / "outstanding.arrow"
    learner = acks.last()
    outstanding = read_ipc_file(outstanding_path) if outstanding_path.exists() else None
    out_seq = batch_seq(outstanding) if outstanding is not None else 0
    acked_seq = max(learner[0] if learner else 0, out_seq)
    stream = BatchStream(config, version=learner[1] if learner else None, acked_seq=acked_seq, stop=stop)
    sink = Sink(to)
    done = 0

    def hand_out(record: pa.RecordBatch) -> bool:
        nonlocal done
        seq = batch_seq(record)
        assert seq is not None  # (stamped by the stream)
        acks.expect(seq, stream.version)
        sink.emit(record)
        try:
            version = acks.wait(seq, stop)
            if version is None:
                return False
            stream.ack(record, version)
            sink.acknowledged(seq)
        except BaseException as exc:
            acks.settled(seq, error=repr(exc))
            raise
        acks.settled(seq)
        done += 1
        return True

    try:
        if outstanding is not None and out_seq > (learner[0] if learner else 0):
            log.info("handing out batch %d again: it was not acknowledged", out_seq)
            if not hand_out(outstanding):
                return done
        while not stop.is_set() and (config.max_steps is None or done < config.max_steps):
            record = stream.next()
            if record is None:
                if stream.exhausted:
                    break
                continue
            write_ipc_file(record, outstanding_path)
            if not hand_out(record):
                break
    finally:
        sink.close()
        stream.close()
    return done


def run(args: argparse.Namespace) -> int:
    from streamrl.child import stop_on_signals

    stop = threading.Event()
    stop_on_signals(stop)
    config = TrainerConfig.load(args.config, **given(args, TrainerConfig))
    if args.to == "-":
        if args.ack is None and args.ack_port is None:
            raise UsageError("--to - needs --ack FILE or --ack-port PORT: how the learner acknowledges each batch")
        ack_path = args.ack or config.state_path / "ack.json"
    else:
        Path(args.to).mkdir(parents=True, exist_ok=True)
        ack_path = args.ack or Path(args.to) / "ack.json"
    if args.ack_port is not None:
        check_port_free(args.ack_host, args.ack_port, "--ack-port")
    if config.replay:
        check_dir(config.replay, "--replay")
    else:
        check_bootstrap_servers(config.kafka.bootstrap_servers, "--bootstrap-servers")
        with as_usage_error():
            config.kafka.client_kwargs()
    try:
        acks = FileAcks(ack_path) if args.ack_port is None else HttpAcks(ack_path, args.ack_host, args.ack_port)
    except OSError as exc:
        raise UsageError(f"--ack-host/--ack-port: cannot listen on {args.ack_host}:{args.ack_port}: "
                         f"{exc.strerror or exc}") from None
    try:
        n = serve(config, args.to, acks, stop)
    finally:
        acks.close()  # after the last answer is sent: the server waits for its handlers
    log.info("%d batches acknowledged", n)
    return 0
