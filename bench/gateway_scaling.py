"""Gateway scaling: aggregate requests/s with logging on for N gateway processes on one port, and
publish -> served with N gateways against one.

For each N of ``--processes``: ``streamrl gateway --workers N`` (N processes on one port, ``SO_REUSEPORT``,
logging on to the embedded broker, token capture frames from the stub) in front of ``gateway_bench.py``'s
stub upstream (``--stub-processes`` of it on one port, so that the stub is not the limit), then:

* throughput: ``--clients`` load-generator processes, each a closed loop at ``--concurrency / --clients``
  (``gateway_bench.closed_loop``), for ``--seconds``; aggregate req/s, failures, and the scaling
  efficiency ``rps(N) / (N x rps(1))``. Over the window where every client is loading, CPU from /proc: the
  gateway processes' CPU per request and cores used, the stubs' and the broker's cores, and the host's busy
  cores. On one host the load generators, the stub and the broker share the cores with the gateways, so
  efficiency also says ``cpu_per_request(1) / cpu_per_request(N)``: how well the gateway itself scales,
  apart from the cores the host has left for it;
* publish -> served: ``--versions`` adapter versions published ``--version-interval`` apart, no client
  load; for each version and each gateway process, the time from the record's publication to the first
  state that gateway wrote on the coordination topic routing it (a gateway writes its state at once when
  its routed version changes), so "served by all N" is the slowest of the N. p50/p99 over versions.

``--gateway-cpus LIST`` (e.g. ``0-7``) runs the gateway processes on those CPUs only (``taskset``) and this
bench, the stub, the broker and the clients on the others, so that the gateways' scaling is read apart from
the cores the load generation takes; the host's core topology (SMT siblings) is recorded either way.

    .venv/bin/python bench/gateway_scaling.py [--processes 1,2,4,8] [--seconds 10] [--concurrency 64]
        [--clients 4] [--stub-processes 2] [--versions 20] [--version-interval 0.5] [--gateway-cpus 0-7]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from gateway_bench import (  # bench/ is on the path when run as a script: the stub and the load loop
    REQUEST,
    _spawn,
    _stop,
    _wait_http,
    children,
    closed_loop,
    cpu_list,
    cpu_seconds,
    gateway_cmd,
    smt_siblings,
)
from harness import stamp

POLICY = "policy"


def _client(url: str, concurrency: int, seconds: float, out: multiprocessing.Queue) -> None:
    out.put(asyncio.run(closed_loop(url, concurrency, seconds, REQUEST, started=lambda: out.put("started"))))


def process_tree(pid: int) -> list[int]:
    """``pid`` and its live descendants (``--workers N`` runs N children under one supervisor)."""
    return [pid, *(q for child in children(pid) for q in process_tree(child))]


def tree_cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):  # exited
            total += cpu_seconds(pid)
    return total


def host_busy_cores_s() -> float:
    """CPU seconds the whole host spent busy (all cores, /proc/stat; idle and iowait excluded)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def throughput(url: str, clients: int, concurrency: int, seconds: float,
               watched: dict[str, list[int]]) -> dict[str, float]:
    """``clients`` processes of closed loops (one Python client tops out below one gateway process), with
    the cores each of ``watched`` (name: process trees) used while every client was loading."""
    ctx = multiprocessing.get_context("spawn")
    out: multiprocessing.Queue = ctx.Queue()
    procs = [ctx.Process(target=_client, args=(url, max(1, concurrency // clients), seconds, out))
             for _ in range(clients)]
    for p in procs:
        p.start()

    def snapshot() -> dict[str, float]:
        return {"wall": time.monotonic(), "host": host_busy_cores_s(),
                **{name: tree_cpu(pids) for name, pids in watched.items()}}

    starts, results, before, after = 0, [], {}, {}
    while len(results) < clients:
        message = out.get()
        if message == "started":
            starts += 1
            if starts == clients:
                before = snapshot()
            continue
        if not results:
            after = snapshot()
        results.append(message)
    for p in procs:
        p.join()
    rps = sum(r["rps"] for r in results)
    window = after["wall"] - before["wall"] if before and after else 0.0
    run = {"rps": rps, "requests": sum(r["requests"] for r in results),
           "failures": sum(r["failures"] for r in results), "cpu_window_s": window}
    if window > 0:
        for name in ["host", *watched]:
            run[f"{name}_cores"] = (after[name] - before[name]) / window
        run["gateway_cpu_ms_per_request"] = 1000 * run["gateway_cores"] / rps
    return run


def wait_gateways(url: str, n: int, timeout: float = 120) -> set[str]:
    """Until a gateway answering on the port sees ``n`` live gateways; returns their ids."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            live = httpx.get(f"{url}/health", timeout=5).json()["gateway"]["live"]
            if len(live) == n:
                return set(live)
        except (httpx.HTTPError, KeyError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{n} live gateways at {url}")


def publish_to_served(bootstrap: str, prefix: str, gateways: set[str], versions: int, interval: float,
                      first_version: int, adapter: Path) -> dict[str, object]:
    """Publish versions and read, from the coordination topic, when each gateway first routed each."""
    from kafka import TopicPartition

    from streamrl.broker.clients import make_consumer
    from streamrl.broker.policy_log import PolicyLog, adapter_record
    from streamrl.broker.schema import GatewayState, RecordError, decode
    from streamrl.broker.topics import Topics

    topics = Topics(prefix)
    log = PolicyLog(bootstrap, topics)
    published: dict[int, float] = {}
    try:
        for v in range(first_version, first_version + versions):
            published[v] = log.publish(adapter_record(POLICY, v, adapter, "stub-model")).created
            time.sleep(interval)
    finally:
        log.close()
    consumer = make_consumer(bootstrap, group_id=None)
    tp = TopicPartition(topics.gateways, 0)
    consumer.assign([tp])
    consumer.seek_to_beginning(tp)
    routed: dict[tuple[str, int], float] = {}
    last = first_version + versions - 1
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all((g, last) in routed for g in gateways):
        for message in consumer.poll(timeout_ms=200).get(tp, ()):
            try:
                state = decode(message.value)
            except RecordError:
                continue
            if isinstance(state, GatewayState) and state.gateway_id in gateways:
                for v in published:
                    if state.routed_version >= v:
                        routed.setdefault((state.gateway_id, v), state.at)
    consumer.close()
    per_gateway = [routed[(g, v)] - published[v] for g in gateways for v in published if (g, v) in routed]
    all_n = [max(routed[(g, v)] for g in gateways) - published[v] for v in published
             if all((g, v) in routed for g in gateways)]

    def pct(xs: list[float], q: float) -> float | None:
        return float(np.percentile(np.asarray(xs) * 1000, q)) if xs else None
    return {"versions": versions, "versions_served_by_all": len(all_n),
            "per_gateway_p50_ms": pct(per_gateway, 50), "per_gateway_p99_ms": pct(per_gateway, 99),
            "all_gateways_p50_ms": pct(all_n, 50), "all_gateways_p99_ms": pct(all_n, 99)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--processes", default="1,2,4,8", help="gateway process counts to run, comma-separated")
    p.add_argument("--seconds", type=float, default=10)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--clients", type=int, default=4, help="load-generator processes")
    p.add_argument("--stub-processes", type=int, default=2)
    p.add_argument("--versions", type=int, default=20)
    p.add_argument("--version-interval", type=float, default=0.5)
    p.add_argument("--gateway-cpus", help="CPUs for the gateway processes (taskset list); the rest get the others")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    pin: list[str] = []
    if args.gateway_cpus:
        gateway_cpus = cpu_list(args.gateway_cpus)
        others = set(os.sched_getaffinity(0)) - gateway_cpus
        if not others or not shutil.which("taskset"):
            raise SystemExit("--gateway-cpus needs taskset and must leave CPUs for the load generation")
        os.sched_setaffinity(0, others)  # inherited by the stub, the broker and the clients spawned below
        pin = ["taskset", "-c", args.gateway_cpus]

    from streamrl.broker.embedded import EmbeddedBroker, free_port
    from streamrl.broker.schema import WEIGHTS_FILE
    from streamrl.broker.topics import Topics

    counts = [int(n) for n in args.processes.split(",")]
    results: dict[str, object] = {
        **stamp(),
        "seconds": args.seconds, "concurrency": args.concurrency, "clients": args.clients,
        "stub_processes": args.stub_processes, "gateway_cpus": args.gateway_cpus,
        "smt_siblings": smt_siblings(), "runs": {}}
    adapter = Path(tempfile.mkdtemp(prefix="gateway-scaling-"))
    (adapter / WEIGHTS_FILE).write_bytes(os.urandom(1024))  # the stub loads nothing; the gateway checks the hash
    stub_port = free_port()
    stub_url = f"http://127.0.0.1:{stub_port}"
    stubs = [_spawn([sys.executable, str(Path(__file__).with_name("gateway_bench.py")), "--serve-stub",
                     str(stub_port)], f"scaling-stub-{i}") for i in range(args.stub_processes)]
    broker = EmbeddedBroker(topics=Topics("bench")).start()
    version = 1
    try:
        _wait_http(f"{stub_url}/health")
        for n in counts:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            cmd = [*pin, *gateway_cmd(stub_url, port, broker.bootstrap_servers, "on"), "--workers", str(n),
                   "--policy-name", POLICY, "--spool-dir", tempfile.mkdtemp(prefix=f"scaling-spool-{n}-")]
            gw = _spawn(cmd, f"scaling-gateway-{n}")
            try:
                _wait_http(f"{url}/health")
                ids = wait_gateways(url, n)
                print(f"[{n} processes] closed loop, concurrency {args.concurrency}, {args.clients} clients ...",
                      flush=True)
                watched = {"gateway": process_tree(gw.pid), "stub": [q for s in stubs for q in process_tree(s.pid)],
                           "broker": process_tree(broker.proc.pid)}
                run: dict[str, object] = {"throughput": throughput(f"{url}/v1/chat/completions", args.clients,
                                                                   args.concurrency, args.seconds, watched)}
                print(f"[{n} processes] publish -> served, {args.versions} versions ...", flush=True)
                run["publish_to_served"] = publish_to_served(broker.bootstrap_servers, "bench", ids, args.versions,
                                                             args.version_interval, version, adapter)
                version += args.versions
            finally:
                _stop(gw)
            results["runs"][str(n)] = run  # type: ignore[index]
            print(f"[{n} processes] {json.dumps(run)}", flush=True)
    finally:
        for stub in stubs:
            _stop(stub)
        broker.stop()
    runs = results["runs"]  # type: ignore[assignment]
    first = runs[str(counts[0])]["throughput"] if counts else {}
    base = first.get("rps", 0.0) / counts[0] if counts else 0.0
    base_cpu = first.get("gateway_cpu_ms_per_request")
    nan = float("nan")
    print(f"\n{'processes':>9} {'req/s':>9} {'efficiency':>10} {'failures':>8} {'gw CPU ms/req':>13} "
          f"{'CPU efficiency':>14} {'cores: gw / stub / broker / host':>32} {'pub->served p50/p99 (all N), ms':>32}")
    for n in counts:
        r = runs[str(n)]
        t = r["throughput"]
        r["efficiency"] = t["rps"] / (n * base) if base else nan
        cpu = t.get("gateway_cpu_ms_per_request")
        r["cpu_efficiency"] = base_cpu / cpu if base_cpu and cpu else nan
        cores = " / ".join(f"{t.get(f'{k}_cores', nan):.1f}" for k in ("gateway", "stub", "broker", "host"))
        s = r["publish_to_served"]
        print(f"{n:>9} {t['rps']:>9.0f} {r['efficiency']:>10.2f} {t['failures']:>8} {cpu or nan:>13.3f} "
              f"{r['cpu_efficiency']:>14.2f} {cores:>32} "
              f"{s['all_gateways_p50_ms'] or nan:>15.0f} / {s['all_gateways_p99_ms'] or nan:<14.0f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
