"""Gateway overhead: added latency and sustained throughput, direct vs through the gateway (logging off/on).

One command runs everything on this machine, each part in its own process so they do not share an
event loop: a stub upstream that answers instantly with realistic vLLM bodies (1,000-token completions
with token ids and logprobs when asked), the embedded broker, the gateway (``streamrl gateway``), and
this load generator. Modes, all in the same run:

  direct   client -> stub
  off      client -> gateway (logging off: forwards bytes) -> stub
  on       client -> gateway (logging on: the client's request with the deferred-capture header; the stub
           answers as ``streamrl engine`` does, vLLM's plain bytes, and queues the capture for the gateway's
           record producer, which reads it on the stub's capture stream; records to Kafka) -> stub
  on-framed  as ``on`` with ``--no-deferred-capture``: the stub answers vLLM's bytes plus a capture frame
           through the gateway's event loop (the path of streamed calls, and of every call before deferral)
  on-json  client -> gateway (logging on, ``--no-token-capture``: asks for ids + logprobs in the JSON, strips
           them, records to Kafka; the path of a plain vLLM upstream) -> stub
  on-dashboard  as ``on``, with ``--dashboard-pages`` dashboard pages open: a child process long-polls
           ``/dashboard/data`` exactly as the page's script does (the dashboard's cost to the gateway)
  off-pinned, on-pinned  (with ``--gateway-cpus``) ``off`` and ``on`` with the gateway process on those CPUs
           alone and everything else on the others
  on-kafka-python  ``on`` with ``--producer-client kafka-python``: records and rewards sent by kafka-python instead
           of librdkafka (the default since commit 27d20dd, 2026-12-03)
  on-nofollow  ``on`` with ``--no-follow-policy``: no policy follower and no coordination, so no tail process
           (the gateway's child that reads the policy and coordination topics; before commit 22475cb two consumers
           and a producer in the gateway's own process, whose threads took its GIL)

For each mode: an open-loop run at a fixed rate (latency p50/p99 measured from each request's scheduled
start, so a stall is not hidden) and a closed-loop run at fixed concurrency (highest sustained req/s).
Added latency = percentile through the gateway minus the same percentile direct. After this full pass,
``--rounds`` more rounds of every mode, interleaved, repeat both runs: on/off throughput and added latency are
then taken round by round (a host's speed drifts between phases, and one stall of it decides a phase's p99).
``--gateway-cpus`` gives the ``-pinned`` modes' gateway process CPUs of its own (everything else runs on the
others). ``--pairs`` then starts ``off`` and ``on`` side by side and alternates short closed-loop bursts between
them, for an on / off ratio taken seconds apart rather than minutes.

    .venv/bin/python bench/gateway_bench.py [--rate 500] [--seconds 10] [--concurrency 32] [--stream-rate 20]
        [--rounds 2] [--gateway-cpus 0-1] [--pairs 20 --pair-seconds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import numpy as np
import orjson
from harness import stamp

ROOT = Path(__file__).resolve().parent.parent
PROMPT_TOKENS = 200
COMPLETION_TOKENS = 1000
MODEL = "stub-model"


SLOW_MS = 10.0
"""An open-loop request slower than this counts as slow: when they came (``open_loop``'s ``slow``) tells one
stall from a slower path."""


# -- the stub upstream ------------------------------------------------------------------------------

def _tokens(seed: int) -> tuple[list[int], list[float], list[str]]:
    rng = random.Random(seed)
    ids = [rng.randrange(100, 150_000) for _ in range(COMPLETION_TOKENS)]
    logprobs = [-rng.random() * 5 for _ in range(COMPLETION_TOKENS)]
    words = [" " + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randrange(2, 7)))
             for _ in range(COMPLETION_TOKENS)]
    return ids, logprobs, words


def stub_bodies(endpoint: str) -> dict[tuple[bool, bool], bytes]:
    """Pre-serialized vLLM-shaped responses for (logprobs asked, token ids asked)."""
    ids, lps, words = _tokens(1)
    prompt = list(range(1000, 1000 + PROMPT_TOKENS))
    usage = {"prompt_tokens": PROMPT_TOKENS, "total_tokens": PROMPT_TOKENS + COMPLETION_TOKENS,
             "completion_tokens": COMPLETION_TOKENS, "prompt_tokens_details": None}
    out = {}
    for want_lp in (False, True):
        for want_ids in (False, True):
            if endpoint == "chat":
                lp = {"content": [{"token": w, "logprob": x, "bytes": list(w.encode()), "top_logprobs": []}
                                  for w, x in zip(words, lps, strict=True)]} if want_lp else None
                body = {"id": "chatcmpl-stub", "object": "chat.completion", "created": 1, "model": MODEL,
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(words),
                                                             "refusal": None, "tool_calls": []},
                                     "logprobs": lp, "finish_reason": "length", "stop_reason": None,
                                     "token_ids": ids if want_ids else None}],
                        "usage": usage, "prompt_logprobs": None,
                        "prompt_token_ids": prompt if want_ids else None, "kv_transfer_params": None}
            else:
                raise ValueError(endpoint)
            out[(want_lp, want_ids)] = orjson.dumps(body)
    return out


def stub_stream_events(want_lp: bool, want_ids: bool) -> list[bytes]:
    ids, lps, words = _tokens(2)
    events = []
    for i, (t, x, w) in enumerate(zip(ids, lps, words, strict=True)):
        choice = {"index": 0, "delta": {"content": w}, "logprobs":
                  {"content": [{"token": w, "logprob": x, "bytes": list(w.encode()), "top_logprobs": []}]}
                  if want_lp else None, "finish_reason": "length" if i == len(ids) - 1 else None,
                  "token_ids": [t] if want_ids else None}
        chunk = {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
                 "choices": [choice]}
        if i == 0:
            chunk["prompt_token_ids"] = list(range(1000, 1000 + PROMPT_TOKENS)) if want_ids else None
        events.append(b"data: " + orjson.dumps(chunk) + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return events


def stub_capture(seed: int) -> bytes:
    """The capture frame ``streamrl engine`` sends beside a reply of COMPLETION_TOKENS tokens."""
    from streamrl.engine.wire import CAPTURE, encode_capture, frame

    ids, lps, _ = _tokens(seed)
    prompt = np.arange(1000, 1000 + PROMPT_TOKENS, dtype=np.int32)
    return frame(CAPTURE, encode_capture([prompt], [(0, 0, np.asarray(ids, np.int32), np.asarray(lps, np.float32))]))


def serve_stub(port: int) -> None:
    import uvloop
    from aiohttp import web

    from streamrl.engine.capture_outbox import HEARTBEAT_S, Outbox, new_token
    from streamrl.engine.wire import (
        BODY,
        CAPTURE_HEADER,
        DEFER_PREFIX,
        FORMAT_VERSION,
        HEARTBEAT,
        PROBE_PATH,
        STREAM_PATH,
        deferred_frame,
        deferred_header,
        frame,
    )

    bodies = stub_bodies("chat")
    streams = {(a, b): b"".join(stub_stream_events(a, b)) for a in (False, True) for b in (False, True)}
    # as streamrl engine answers a request with the capture header: vLLM's plain bytes in B frames, the capture
    # in a C frame (before [DONE] when streaming)
    framed_body = frame(BODY, bodies[(False, False)]) + stub_capture(1)
    events = stub_stream_events(False, False)
    framed_stream = b"".join(frame(BODY, e) for e in events[:-1]) + stub_capture(2) + frame(BODY, events[-1])
    capture = stub_capture(1)[5:]  # the payload of the C frame
    counts = (1, PROMPT_TOKENS, COMPLETION_TOKENS)
    models = orjson.dumps({"object": "list", "data": [{"id": MODEL, "object": "model", "parent": None}]})
    probe = orjson.dumps({"format": FORMAT_VERSION, "deferred": True})
    outboxes: dict[str, Outbox] = {}
    anomalies: collections.Counter[str] = collections.Counter()

    async def chat(request: web.Request) -> web.StreamResponse:
        req = orjson.loads(await request.read())
        key = (bool(req.get("logprobs")), bool(req.get("return_token_ids")))
        asked = request.headers.get(CAPTURE_HEADER)
        if asked is not None and asked.startswith(DEFER_PREFIX) and not req.get("stream"):
            # as streamrl engine answers a deferred request: vLLM's plain bytes, the capture to the outbox
            token = new_token()
            box = outboxes.setdefault(asked[len(DEFER_PREFIX):], Outbox())
            box.put(deferred_frame(token, bodies[(False, False)], capture), anomalies)
            return web.Response(body=bodies[(False, False)], content_type="application/json",
                                headers={CAPTURE_HEADER: deferred_header(token, counts)})
        framed = asked is not None
        headers = {CAPTURE_HEADER: "1"} if framed else {}
        if req.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", **headers})
            await resp.prepare(request)
            # instant: every token at once, the gateway still handles each event
            await resp.write(framed_stream if framed else streams[key])
            await resp.write_eof()
            return resp
        return web.Response(body=framed_body if framed else bodies[key], content_type="application/json",
                            headers=headers)

    async def capture_stream(request: web.Request) -> web.StreamResponse:
        box = outboxes.setdefault(request.query["consumer"], Outbox())
        claim = box.reader = object()
        resp = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        await resp.prepare(request)
        with contextlib.suppress(ConnectionError):
            while box.reader is claim:
                if not box.frames:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(HEARTBEAT_S):
                            await box.ready.wait()
                await resp.write(box.take() if box.frames else frame(HEARTBEAT, b""))
        return resp

    async def lora(_request: web.Request) -> web.Response:  # hot-swap: loads and unloads take no time here
        return web.Response(text="Success")

    async def capture_probe(_request: web.Request) -> web.Response:
        return web.Response(body=probe, content_type="application/json")

    async def health(_request: web.Request) -> web.Response:
        return web.Response(text="")

    async def list_models(_request: web.Request) -> web.Response:
        return web.Response(body=models, content_type="application/json")

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get(PROBE_PATH, capture_probe)
    app.router.add_get(STREAM_PATH, capture_stream)
    app.router.add_post("/v1/load_lora_adapter", lora)
    app.router.add_post("/v1/unload_lora_adapter", lora)
    uvloop.install()
    # reuse_port: several stub processes may share the port (bench/gateway_scaling.py), so that the stub is
    # not what limits many gateway processes
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None, reuse_port=True)


# -- the load generator -----------------------------------------------------------------------------

REQUEST = orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}],
                        "max_tokens": COMPLETION_TOKENS, "temperature": 1.0})
STREAM_REQUEST = orjson.dumps({**orjson.loads(REQUEST), "stream": True})
LARGE_REQUEST = orjson.dumps({**orjson.loads(REQUEST), "logprobs": True, "return_token_ids": True})
"""What the gateway itself sends upstream with logging on: the direct path with it is the transport floor
of the 107 KB bodies that logging on moves (reported, not subtracted)."""


async def _one(session: aiohttp.ClientSession, url: str, body: bytes) -> int:
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
        await r.read()
        return r.status


WARM_S = 1.0
"""Seconds of load at the phase's own rate before its measured part: the client's, the gateway's and the stub's
connection pools grow to the rate's concurrency and every path has run (a gateway is started per phase, a
production one runs for hours). What the warm-up itself met is reported beside the phase, not hidden."""


async def _paced(session: aiohttp.ClientSession, url: str, body: bytes, rate: float,
                 seconds: float) -> tuple[list[float], list[float], dict[str, int], float]:
    """Requests started on a fixed schedule for ``seconds``; each one's latency from its scheduled start (so a
    late client counts against the latency, never hides it), its scheduled offset, the failures by kind and the
    achieved rate. One pacer starts each request at its time, rather than thousands of sleeping tasks made up
    front."""
    latencies: list[float] = []
    starts: list[float] = []
    kinds: dict[str, int] = {}

    async def fire(offset: float, scheduled: float) -> None:
        try:
            status: int | str = await _one(session, url, body)
        except aiohttp.ClientError as exc:
            status = type(exc).__name__
        if status != 200:
            kinds[str(status)] = kinds.get(str(status), 0) + 1
        latencies.append(time.perf_counter() - scheduled)
        starts.append(offset)

    n = int(rate * seconds)
    start = time.perf_counter() + 0.01
    running: set[asyncio.Task[None]] = set()
    for i in range(n):
        scheduled = start + i / rate
        delay = scheduled - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(fire(i / rate, scheduled))
        running.add(task)
        task.add_done_callback(running.discard)
    await asyncio.gather(*running)
    return latencies, starts, kinds, n / (time.perf_counter() - start)


def _slow(latencies_ms: np.ndarray, starts: list[float]) -> dict[str, object]:
    """The requests over ``SLOW_MS`` and when they were due: one stall makes a burst, a slower path spreads
    them over the phase."""
    slow = np.asarray(starts)[latencies_ms > SLOW_MS]
    return {"over_ms": SLOW_MS, "requests": int(slow.size), "max_ms": float(latencies_ms.max()),
            "first_s": float(slow.min()) if slow.size else None, "last_s": float(slow.max()) if slow.size else None}


async def open_loop(url: str, rate: float, seconds: float, body: bytes,
                    warmed: Callable[[], None] | None = None) -> dict[str, float]:
    """Open-loop latency at ``rate`` for ``seconds``, after ``WARM_S`` of the same load (``warmed`` is called
    between the two, nothing in flight)."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await _one(session, url, body)
        warm, warm_starts, _, _ = await _paced(session, url, body, rate, WARM_S)
        if warmed is not None:
            warmed()
        latencies, starts, kinds, achieved = await _paced(session, url, body, rate, seconds)
    lat = np.asarray(latencies) * 1000
    return {"rate": rate, "achieved_rps": achieved, "p50_ms": float(np.percentile(lat, 50)),
            "p90_ms": float(np.percentile(lat, 90)), "p99_ms": float(np.percentile(lat, 99)),
            "failures": sum(kinds.values()), "failure_kinds": kinds, "requests": len(latencies),
            "slow": _slow(lat, starts), "warm_up": _slow(np.asarray(warm) * 1000, warm_starts)}


async def closed_loop(url: str, concurrency: int, seconds: float, body: bytes,
                      started: Callable[[], None] | None = None) -> dict[str, float]:
    """``concurrency`` requests in flight for ``seconds`` after a warm-up; ``started`` is called when the
    measured part begins (a caller timing CPU over the loaded window)."""
    connector = aiohttp.TCPConnector(limit=0)
    done = failures = 0
    async with aiohttp.ClientSession(connector=connector) as session:
        for _ in range(20):
            await _one(session, url, body)
        if started is not None:
            started()
        stop = time.perf_counter() + seconds

        async def loop() -> None:
            nonlocal done, failures
            while time.perf_counter() < stop:
                try:
                    ok = await _one(session, url, body) == 200
                except aiohttp.ClientError:
                    ok = False
                done += 1
                failures += not ok

        started = time.perf_counter()
        await asyncio.gather(*(loop() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return {"concurrency": concurrency, "rps": done / elapsed, "failures": failures, "requests": done}


# -- orchestration ----------------------------------------------------------------------------------

def _wait_http(url: str, timeout: float = 30) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1).status_code == 200:
                return
        time.sleep(0.05)
    raise TimeoutError(url)


def wait_drained(gateway_url: str, timeout: float = 120) -> float:
    """Wait until the gateway's producer has settled every record offered so far (delivered, failed,
    dropped or invalid), so that one phase's backlog does not load the next; returns the seconds waited."""
    import httpx

    start = time.monotonic()
    while time.monotonic() - start < timeout:
        p = httpx.get(f"{gateway_url}/health", timeout=5).json()["producer"]
        if p is None or p["delivered"] + p["failed"] + p["dropped"] + p["invalid"] >= p["offered"]:
            break
        time.sleep(0.1)
    return time.monotonic() - start


LOG_DIR = Path(tempfile.gettempdir()) / "streamrl-gateway-bench"


def _spawn(cmd: list[str], name: str) -> subprocess.Popen:
    """A child with its output in ``LOG_DIR/<name>.log`` (a pipe nobody reads would fill and stall it)."""
    LOG_DIR.mkdir(exist_ok=True)
    log = open(LOG_DIR / f"{name}.log", "wb")  # noqa: SIM115 - the child owns it
    return subprocess.Popen(cmd, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)


def _stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu(pid: int) -> dict[int, float]:
    """User + system CPU seconds of each live thread of a process, by thread id (/proc/PID/task/*/stat)."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            out[int(stat.parent.name)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def on_cpu_seconds(pid: int, tid: int) -> float:
    """Time a thread ran on a CPU, to the nanosecond (/proc/PID/task/TID/schedstat, 1st field; the stat file's
    user + system time is sampled at the scheduler's tick)."""
    with contextlib.suppress(OSError, IndexError, ValueError):
        return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0]) / 1e9
    return 0.0


def run_delay_seconds(pid: int, tid: int) -> float:
    """Time a thread spent runnable but waiting for a CPU (/proc/PID/task/TID/schedstat, 2nd field): a
    stall that is the scheduler's, not the GIL's or the code's."""
    with contextlib.suppress(OSError, IndexError, ValueError):
        return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[1]) / 1e9
    return 0.0


class ThreadCpu:
    """The CPU a process spends in one phase, split into its main thread (the gateway's event loop) and
    the others (producer pipe drain, policy follower, executor threads): which side a stall comes from."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.total0, self.threads0 = cpu_seconds(pid), thread_cpu(pid)
        self.delay0 = {tid: run_delay_seconds(pid, tid) for tid in self.threads0}
        self.main_on_cpu0, self.wall0 = on_cpu_seconds(pid, pid), time.perf_counter()

    def result(self, requests: int) -> dict[str, object]:
        total, threads = cpu_seconds(self.pid) - self.total0, thread_cpu(self.pid)
        delays = {tid: run_delay_seconds(self.pid, tid) - self.delay0.get(tid, 0.0) for tid in threads}
        delay = delays.pop(self.pid, 0.0)
        per = {tid: s - self.threads0.get(tid, 0.0) for tid, s in threads.items()}
        main = per.pop(self.pid, 0.0)
        others = sum(per.values())
        n = max(1, requests)
        main_on_cpu = on_cpu_seconds(self.pid, self.pid) - self.main_on_cpu0
        return {"main_thread_cpu_s": main, "other_threads_cpu_s": others, "main_thread_run_delay_s": delay,
                "main_thread_busy": main_on_cpu / (time.perf_counter() - self.wall0),
                "main_thread_on_cpu_ms_per_request": main_on_cpu * 1000 / n,
                "other_threads_run_delay_s": sum(delays.values()),
                "exited_threads_cpu_s": max(0.0, total - main - others),
                "main_thread_cpu_ms_per_request": main * 1000 / n, "other_threads_cpu_ms_per_request": others * 1000 / n,
                "busiest_other_threads_cpu_s": {str(tid): s for tid, s in sorted(per.items(), key=lambda kv: -kv[1])[:4]
                                                if s > 0}}


def host_cpu_counters() -> dict[str, float]:
    """Counters of CPU starvation outside any one thread: cgroup throttling (a CPU quota stops every thread
    of the container at once, which a thread's run delay shows but cannot explain), the host's steal time
    (a virtual machine's CPUs taken by the hypervisor: invisible to run delay) and CPU pressure (time in
    which some runnable task of the machine or container waited for a CPU)."""
    out: dict[str, float] = {}
    for path, scale in ((Path("/sys/fs/cgroup/cpu.stat"), 1e-6), (Path("/sys/fs/cgroup/cpu/cpu.stat"), 1e-9),
                        (Path("/sys/fs/cgroup/cpu,cpuacct/cpu.stat"), 1e-9)):
        with contextlib.suppress(OSError, ValueError):
            fields = dict(line.split() for line in path.read_text().splitlines() if line.strip())
            out["cgroup_periods"] = float(fields.get("nr_periods", 0))
            out["cgroup_throttled_periods"] = float(fields.get("nr_throttled", 0))
            throttled = fields.get("throttled_usec", fields.get("throttled_time", 0))
            out["cgroup_throttled_s"] = float(throttled) * scale
            break
    with contextlib.suppress(OSError, ValueError, IndexError):  # a VM's vCPUs held by the hypervisor
        out["host_steal_s"] = int(Path("/proc/stat").read_text().split("\n", 1)[0].split()[8]) / os.sysconf("SC_CLK_TCK")
    for path in (Path("/sys/fs/cgroup/cpu.pressure"), Path("/proc/pressure/cpu")):
        with contextlib.suppress(OSError, ValueError, IndexError):
            some = path.read_text().splitlines()[0]
            out["cpu_pressure_some_s"] = float(some.rsplit("total=", 1)[1]) / 1e6
            break
    return out


INTERRUPT_KINDS = ("irq_s", "softirq_s", "ipis", "net_rx")


def interrupt_counters() -> dict[int, dict[str, float]]:
    """Per CPU, what interrupts took from it: seconds in hard and soft interrupt handlers (``/proc/stat``),
    inter-processor interrupts (rescheduling and function-call IPIs: a wake-up of a thread on another CPU; in a
    virtual machine each costs exits on both vCPUs) and network receive softirqs (loopback traffic is delivered
    in them). Busy neighbours that compute do not interrupt a process; ones that talk over sockets and pipes,
    wake threads and allocate may, on whichever CPU the handler runs. ``interrupts_on`` sums CPUs."""
    out: dict[int, dict[str, float]] = collections.defaultdict(lambda: dict.fromkeys(INTERRUPT_KINDS, 0.0))
    tick = os.sysconf("SC_CLK_TCK")
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/stat").read_text().splitlines():
            name, *fields = line.split()
            if name.startswith("cpu") and name != "cpu":
                out[int(name[3:])]["irq_s"] = int(fields[5]) / tick
                out[int(name[3:])]["softirq_s"] = int(fields[6]) / tick
    # both files: a header of CPU columns, then one row of counts per kind
    for path, rows, kind in ((Path("/proc/interrupts"), ("RES:", "CAL:"), "ipis"),
                             (Path("/proc/softirqs"), ("NET_RX:",), "net_rx")):
        with contextlib.suppress(OSError, ValueError, IndexError):
            lines = path.read_text().splitlines()
            columns = [int(c[3:]) for c in lines[0].split()]
            for line in lines[1:]:
                name, *fields = line.split()
                if name in rows:
                    for cpu, value in zip(columns, fields, strict=False):
                        out[cpu][kind] += int(value)
    return dict(out)


def interrupts_on(before: dict[int, dict[str, float]], after: dict[int, dict[str, float]],
                  cpus: set[int] | None = None) -> dict[str, float]:
    """What ``interrupt_counters`` grew by between two readings, summed over ``cpus`` (every CPU when None)."""
    return {kind: sum(after[c][kind] - before[c][kind] for c in after if c in before and (cpus is None or c in cpus))
            for kind in INTERRUPT_KINDS}


def cpu_list(text: str) -> set[int]:
    """``0-3,8`` -> {0, 1, 2, 3, 8} (the kernel's and taskset's list format; sysfs ends it with a newline,
    and an empty list is no CPUs)."""
    cpus: set[int] = set()
    for part in filter(None, text.strip().split(",")):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def smt_siblings() -> list[str]:
    """Each physical core's logical CPUs, as the kernel lists them (``0,8`` where two threads share one)."""
    lists = {path.read_text().strip() for path in
             Path("/sys/devices/system/cpu").glob("cpu[0-9]*/topology/thread_siblings_list")}
    return sorted(lists, key=lambda x: min(cpu_list(x)))


def counters_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after if k in before}


def processes_run_delay_s(pids: list[int]) -> float:
    """Time all threads of these processes spent runnable but off-CPU, in all (cumulative counter)."""
    return sum(run_delay_seconds(pid, tid) for pid in pids for tid in thread_cpu(pid))


LAG_METRIC = "streamrl_gateway_event_loop_lag_seconds"


GC_METRIC = "streamrl_gateway_gc_pause_seconds"


def histogram_buckets(gateway_url: str, metric: str = LAG_METRIC) -> dict[float, float]:
    """Cumulative counts of one of the gateway's histograms by upper bound (seconds), its labels summed: the
    event loop's lag, or (``GC_METRIC``) its collections' pauses, all generations together."""
    import httpx

    out: dict[float, float] = collections.defaultdict(float)
    for line in httpx.get(f"{gateway_url}/metrics", timeout=5).text.splitlines():
        if line.startswith(metric + "_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[float(le)] += float(line.rsplit(" ", 1)[1])
    return dict(out)


def histogram_summary(before: dict[float, float], after: dict[float, float]) -> dict[str, object]:
    """Samples and the p50 / p99 / max of one phase (lag or pause), each as the upper bound of its bucket (ms)."""
    cum = sorted((le, after[le] - before.get(le, 0.0)) for le in after)
    total = cum[-1][1] if cum else 0.0

    def quantile(q: float) -> float | None:
        return next((le * 1000 for le, c in cum if c >= q * total), None) if total else None

    over = {f">{le * 1000:g}ms": total - c for le, c in cum if le in (0.005, 0.01, 0.02)}
    return {"samples": int(total), "p50_ms": quantile(0.5), "p99_ms": quantile(0.99), "max_ms": quantile(1.0),
            "samples_over": over}


def producer_waited(gateway_url: str) -> int:
    import httpx

    p = httpx.get(f"{gateway_url}/health", timeout=5).json()["producer"]
    return 0 if p is None else int(p["waited"])


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(stat.parent.name))
    return out


PINNED: tuple[set[int], set[int]] | None = None
"""With ``--gateway-cpus``: the CPUs of the gateway process of a ``-pinned`` mode, and everything else's (its
record-producer process, the stub, the broker, this load generator). The gateways of the other modes, and
their producers, may run on every CPU."""

GATEWAY_MODES = ("off", "on", "on-framed", "on-json", "on-dashboard", "off-pinned", "on-pinned", "on-nofollow",
                 "on-kafka-python")
"""``<mode>-pinned``: ``<mode>`` with the gateway process on ``--gateway-cpus`` alone and its producer process
off them, in the same rounds as the unpinned modes: what placement does, on the same host at the same time."""


def pin_away(pid: int, cpus: set[int]) -> None:
    """Move every thread of ``pid`` (a thread's affinity is its own once it has started) onto ``cpus``."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(task.name), cpus)


def gateway_cmd(stub_url: str, port: int, bootstrap: str, mode: str) -> list[str]:
    cmd = [sys.executable, "-m", "streamrl.cli", "--log-level", "WARNING", "gateway", "--upstream", stub_url,
           "--bootstrap-servers", bootstrap, "--port", str(port), "--topic-prefix", "bench"]
    base = mode.removesuffix("-pinned").removesuffix("-compute").removesuffix("-memory")
    return {"off": [*cmd, "--no-logging"], "on": cmd, "on-framed": [*cmd, "--no-deferred-capture"],
            "on-json": [*cmd, "--no-token-capture"], "on-dashboard": cmd,
            "on-nofollow": [*cmd, "--no-follow-policy"],
            "on-kafka-python": [*cmd, "--producer-client", "kafka-python"]}[base]


def poll_dashboard(gateway_url: str, pages: int) -> None:
    """``pages`` open dashboard pages: each long-polls ``/dashboard/data`` with the page's ``since`` and
    ``seq`` (gateway/static/dashboard.js ``poll``), until killed; prints the answers it got at exit."""
    import uvloop

    answers = 0

    async def page(session: aiohttp.ClientSession) -> None:
        nonlocal answers
        since, seq = 0.0, None
        while True:
            q = {"since": str(since)} | ({"seq": str(seq)} if seq is not None else {})
            async with session.get(f"{gateway_url}/dashboard/data", params=q) as r:
                d = orjson.loads(await r.read())
            answers += 1
            if d["points"]:
                since = d["points"][-1]["time"]
            seq = d["seq"]

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(page(session) for _ in range(pages)))

    signal.signal(signal.SIGTERM, lambda *_: (print(f"dashboard answers: {answers}", flush=True), sys.exit(0)))
    uvloop.run(run())


def record_sizes(bootstrap: str, topic: str = "bench.completions", compress: bool = False) -> dict[str, float]:
    """Read back a sample of the records the gateway wrote: bytes per token, encoded and compressed."""
    from kafka import TopicPartition

    from streamrl.broker.clients import make_consumer
    from streamrl.broker.schema import CompletionRecord, decode

    consumer = make_consumer(bootstrap, group_id=None)
    tps = [TopicPartition(topic, p) for p in sorted(consumer.partitions_for_topic(topic))]
    consumer.assign(tps)
    consumer.seek_to_beginning(*tps)
    sizes, tokens, values = [], [], []
    deadline = time.monotonic() + 10
    while len(sizes) < 200 and time.monotonic() < deadline:
        for batch in consumer.poll(timeout_ms=500).values():
            for m in batch:
                rec = decode(m.value)
                assert isinstance(rec, CompletionRecord)
                sizes.append(len(m.value))
                values.append(m.value)
                tokens.append(rec.prompt_token_ids.size + rec.completion_token_ids.size)
    consumer.close()
    import zstandard

    batch = b"".join(values[:50])  # what a producer batch compresses (zstd, as the gateway's producer)
    compressed = len(zstandard.ZstdCompressor(level=3).compress(batch))
    n_tokens = float(np.sum(tokens[:50]))
    return {"records": len(sizes), "bytes_per_record": float(np.mean(sizes)),
            "tokens_per_record": float(np.mean(tokens)),
            "bytes_per_token": float(np.sum(sizes) / np.sum(tokens)),
            # the stub sends the same body every time, so only distinct (vLLM) records say anything here
            "zstd_bytes_per_token": compressed / n_tokens if compress and n_tokens else None}


def vllm_record_sizes(upstream: str, requests: int = 20, max_tokens: int = 256) -> dict[str, float]:
    """Bytes per token of records of real vLLM completions (real logprobs), through a gateway."""
    import httpx

    from streamrl.broker.embedded import EmbeddedBroker, free_port
    from streamrl.broker.topics import Topics
    from streamrl.gateway.config import GatewayConfig, GatewayKafka
    from streamrl.gateway.server import GatewayServer

    with EmbeddedBroker(topics=Topics("sizes")) as broker:
        config = GatewayConfig(upstreams=(upstream,),
                               kafka=GatewayKafka(bootstrap_servers=broker.bootstrap_servers, topic_prefix="sizes"),
                               port=free_port(), follow_policy=False)
        with GatewayServer(config) as gw:
            model = httpx.get(f"{upstream}/v1/models").json()["data"][0]["id"]
            for i in range(requests):
                httpx.post(f"{gw.url}/v1/chat/completions", timeout=120, json={
                    "model": model, "max_tokens": max_tokens, "seed": i,
                    "messages": [{"role": "user", "content": f"Question {i}: tell me a long story about the sea."}]})
            deadline = time.monotonic() + 30
            while gw.gateway.producer.stats.delivered < requests and time.monotonic() < deadline:
                time.sleep(0.05)
        return record_sizes(broker.bootstrap_servers, "sizes.completions", compress=True)


RATIOS = (("on", "off"), ("on-pinned", "off-pinned"), ("on-nofollow", "off"), ("on-kafka-python", "off"))
"""The closed-loop req/s ratios printed per round: logging's cost, placed alike, and what the variants do."""


def print_table(results: dict[str, object]) -> None:
    """The figures of docs/benchmarks.md, one row each."""
    modes = [m for m in ("direct", *GATEWAY_MODES) if m in results]

    def row(name: str, cell: Callable[[dict[str, object]], str]) -> None:
        cells = []
        for m in modes:
            try:
                cells.append(cell(results[m]))  # type: ignore[arg-type]
            except (KeyError, TypeError):
                cells.append("")
        print(f"| {name} | " + " | ".join(cells) + " |")

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.3g}"

    rate = results["rate"]
    print("\n| | " + " | ".join(modes) + " |\n| --- |" + " --- |" * len(modes))
    row(f"p50 / p90 / p99 at {rate:g} req/s (ms)",
        lambda e: "{p50_ms:.2f} / {p90_ms:.2f} / {p99_ms:.2f}".format(**e["latency"]))
    row("highest sustained req/s", lambda e: f"{e['throughput']['rps']:,.0f}")
    row("CPU per request, open loop: main thread + others (ms)",
        lambda e: "{main_thread_cpu_ms_per_request:.3f} + {other_threads_cpu_ms_per_request:.3f}".format(
            **e["latency"]["threads"]))
    row("CPU per request, closed loop: main thread + others (ms)",
        lambda e: "{main_thread_cpu_ms_per_request:.3f} + {other_threads_cpu_ms_per_request:.3f}".format(
            **e["throughput"]["threads"]))
    row("runnable but off-CPU, open loop: main thread / others (ms in all)",
        lambda e: "{:.1f} / {:.1f}".format(*(e["latency"]["threads"][k] * 1000 for k in (
            "main_thread_run_delay_s", "other_threads_run_delay_s"))))
    row("event-loop lag, open loop: p50 / p99 / max (ms, bucket bounds)",
        lambda e: " / ".join(ms(e["latency"]["event_loop_lag"][k]) for k in ("p50_ms", "p99_ms", "max_ms")))
    row("event-loop lag samples over 5 / 10 / 20 ms", lambda e: " / ".join(
        f"{v:g}" for v in e["latency"]["event_loop_lag"]["samples_over"].values()))
    row("open loop: producer process off-CPU / CPU pressure / cgroup throttled (ms in all)",
        lambda e: " / ".join(f"{e['latency']['host'].get(k, float('nan')) * 1000:.1f}" for k in (
            "producer_process_run_delay_s", "cpu_pressure_some_s", "cgroup_throttled_s")))
    row("records waited (pipe full): open / closed loop",
        lambda e: f"{e['latency']['records_waited']} / {e['throughput']['records_waited']}")
    rounds, summary = results["rounds"], results["summary"]
    print(f"\n{summary['rounds']} rounds (the first is the table above, the rest interleaved):")
    for mode, got in rounds.items():
        line = " / ".join(f"{x:.2f}" for x in got["p99_ms"])
        if mode != "direct":
            line += (f"  (added p99 median {summary[mode]['added_p99_ms_median']:.2f} ms);  req/s "
                     + " / ".join(f"{x:,.0f}" for x in got["rps"]) + f"  (median {np.median(got['rps']):,.0f})")
        print(f"  {mode:13s} p99 ms " + line)
    print("  event loop's CPU per request (ms) and busy share, closed loop: " + "; ".join(
        f"{m} " + " / ".join(f"{x:.3f} ({b:.0%})" for x, b in zip(rounds[m]["main_thread_cpu_ms_per_request"],
                                                                 rounds[m]["main_thread_busy"], strict=True))
        for m in summary["main_thread_cpu_ms_per_request_median"]))
    print("  stub's / client's loop busy, closed loop, interleaved rounds: " + "; ".join(
        f"{m} " + " / ".join(f"{a:.0%}, {b:.0%}" for a, b in zip(rounds[m].get("stub_busy", []),
                                                              rounds[m].get("client_busy", []), strict=True))
        for m in summary["main_thread_cpu_ms_per_request_median"]))
    print("  interrupts per call, closed loop (all CPUs: irq + softirq us, IPIs, NET_RX; on the gateway's CPUs when "
          "pinned: us, IPIs): " + "; ".join(
              f"{m} " + " / ".join(
                  f"{a:.0f}, {b:.2f}, {c:.2f}" + (f" ({d:.0f}, {e:.2f})" if m.endswith("-pinned") else "")
                  for a, b, c, d, e in zip(*(rounds[m].get(k, []) for k in (
                      "interrupt_us_per_request", "ipis_per_request", "net_rx_per_request",
                      "gateway_cpus_interrupt_us_per_request", "gateway_cpus_ipis_per_request")), strict=True))
              for m in summary["main_thread_cpu_ms_per_request_median"]))
    for mode, baseline in RATIOS:
        if mode in rounds and baseline in rounds:
            ratios = np.divide(rounds[mode]["rps"], rounds[baseline]["rps"])
            print(f"  {mode} / {baseline} per round: " + " / ".join(f"{x:.2f}" for x in ratios)
                  + f"  (median {np.median(ratios):.2f})")


def measure_mode(mode: str, url: str, gw: subprocess.Popen | None, pages: subprocess.Popen | None,
                 stub: subprocess.Popen, args: argparse.Namespace) -> dict[str, object]:
    """One mode's open-loop latency, closed-loop throughput and CPU (of the gateway, or of the stub for
    ``direct``), and its streaming latency; ``pages``: the open dashboards of ``on-dashboard``."""
    pid = (gw or stub).pid
    gw_url = url.rsplit("/v1/", 1)[0]
    print(f"[{mode}] open loop at {args.rate:.0f} req/s for {args.seconds:.0f}s ...", flush=True)
    # children: the gateway's record-producer process, when logging is on
    threads, host0, helpers = ThreadCpu(pid), host_cpu_counters(), children(pid)
    helper_delay0 = processes_run_delay_s(helpers)
    lag0, waited0 = (histogram_buckets(gw_url), producer_waited(gw_url)) if gw is not None else ({}, 0)
    lat = asyncio.run(open_loop(url, args.rate, args.seconds, REQUEST))
    lat["threads"] = threads.result(lat["requests"])
    lat["host"] = counters_delta(host0, host_cpu_counters())
    lat["host"]["producer_process_run_delay_s"] = processes_run_delay_s(helpers) - helper_delay0
    if gw is not None:
        lat["event_loop_lag"] = histogram_summary(lag0, histogram_buckets(gw_url))
        lat["records_waited"] = producer_waited(gw_url) - waited0
        lat["drain_s"] = wait_drained(gw_url)
    print(f"[{mode}] closed loop, concurrency {args.concurrency} ...", flush=True)
    cpu0, helper0 = cpu_seconds(pid), sum(cpu_seconds(c) for c in helpers)
    threads, waited0 = ThreadCpu(pid), producer_waited(gw_url) if gw is not None else 0
    thr = asyncio.run(closed_loop(url, args.concurrency, args.seconds, REQUEST))
    n = max(1, thr["requests"])
    thr["cpu_ms_per_request"] = (cpu_seconds(pid) - cpu0) * 1000 / n
    thr["threads"] = threads.result(thr["requests"])
    if gw is not None:
        thr["records_waited"] = producer_waited(gw_url) - waited0
    thr["cpu_of"] = "stub" if gw is None else "gateway"
    if gw is not None:
        thr["drain_s"] = wait_drained(gw_url)
    # after the drain: the producer process's CPU for this phase's records, all of them sent
    thr["producer_process_cpu_ms_per_request"] = (sum(cpu_seconds(c) for c in helpers) - helper0) * 1000 / n
    entry: dict[str, object] = {"latency": lat, "throughput": thr}
    if gw is None:
        entry["large_body_latency"] = asyncio.run(open_loop(url, args.rate, args.seconds, LARGE_REQUEST))
    if args.stream_rate:
        entry["stream_latency"] = asyncio.run(open_loop(url, args.stream_rate, args.seconds, STREAM_REQUEST))
    if gw is not None:
        import httpx

        health = httpx.get(f"{gw_url}/health").json()
        entry["producer"] = health["producer"]
        if pages is not None:  # how many dashboard answers the pages got during the mode
            pages.terminate()
            entry["dashboard"] = {"pages": args.dashboard_pages,
                                  "answers": pages.communicate(timeout=10)[0].strip()}
    return entry


@contextlib.contextmanager
def gateway_for(mode: str, stub_url: str, port: int, bootstrap: str, pages: int,
                procs: list[subprocess.Popen]) -> Iterator[tuple[subprocess.Popen, subprocess.Popen | None]]:
    """The gateway of ``mode`` on ``port`` (in ``procs`` while it runs, so a failure still stops it), healthy,
    and for ``on-dashboard`` the child process of open dashboard pages; all stopped on leaving."""
    pinned = mode.endswith("-pinned")
    pin = [] if PINNED is None else ["taskset", "-c", ",".join(map(str, sorted(
        PINNED[0] if pinned else PINNED[0] | PINNED[1])))]  # unpinned: every CPU, not this process's
    gw = _spawn([*pin, *gateway_cmd(stub_url, port, bootstrap, mode)], f"gateway-{mode}")
    procs.append(gw)
    poller = None
    try:
        _wait_http(f"http://127.0.0.1:{port}/health")
        if PINNED is not None and pinned:  # the record producer (started before /health answers) elsewhere
            for child in children(gw.pid):
                pin_away(child, PINNED[1])
        if mode == "on-dashboard":
            poller = subprocess.Popen([sys.executable, __file__, "--poll-dashboard", f"http://127.0.0.1:{port}",
                                       "--dashboard-pages", str(pages)], stdout=subprocess.PIPE, text=True)
        yield gw, poller
    finally:
        if poller is not None and poller.poll() is None:
            poller.kill()
            poller.wait()
        _stop(gw)
        procs.remove(gw)


def open_phase(url: str, gateway_url: str, pid: int | None, args: argparse.Namespace) -> dict[str, object]:
    """One open-loop phase of a round: latency, its slow requests, the host's steal and, through a gateway
    (``pid``), the event loop's largest lag, the collections in the phase and the loop's wait for a CPU."""
    threads, host0 = (ThreadCpu(pid) if pid else None), host_cpu_counters()
    lags = [histogram_buckets(gateway_url)] if pid else []

    def warmed() -> None:  # the lag histogram and the thread counters from here on, the warm-up's apart
        nonlocal threads, gc0
        if pid:
            lags.append(histogram_buckets(gateway_url))
            threads, gc0 = ThreadCpu(pid), histogram_buckets(gateway_url, GC_METRIC)

    gc0 = {}
    lat = asyncio.run(open_loop(url, args.rate, args.seconds, REQUEST, warmed))
    row: dict[str, object] = {k: lat[k] for k in ("p50_ms", "p99_ms", "failures", "slow", "warm_up")}
    row["host_steal_s"] = counters_delta(host0, host_cpu_counters())["host_steal_s"]
    if threads is not None:
        pauses = histogram_summary(gc0, histogram_buckets(gateway_url, GC_METRIC))
        row["warm_up"] = {**lat["warm_up"], "event_loop_lag_max_ms": histogram_summary(*lags)["max_ms"]}
        row.update(event_loop_lag_max_ms=histogram_summary(lags[-1], histogram_buckets(gateway_url))["max_ms"],
                   gc_pause_max_ms=pauses["max_ms"], gc_collections=pauses["samples"],
                   main_thread_run_delay_ms=threads.result(lat["requests"])["main_thread_run_delay_s"] * 1000)
    return row


def closed_phase(url: str, pid: int, stub_pid: int, args: argparse.Namespace) -> dict[str, object]:
    """One closed-loop phase of a round through a gateway: req/s, the event loop's time on a CPU per call and
    busy share, and the stub's and this client's loops' busy share (which process bounds the req/s)."""
    threads, stub_loop, client_loop = ThreadCpu(pid), ThreadCpu(stub_pid), ThreadCpu(os.getpid())
    irq0 = interrupt_counters()
    thr = asyncio.run(closed_loop(url, args.concurrency, args.seconds, REQUEST))
    irq1 = interrupt_counters()
    irq, irq_gw = interrupts_on(irq0, irq1), interrupts_on(irq0, irq1, os.sched_getaffinity(pid))
    loop_cpu = threads.result(thr["requests"])
    n = max(thr["requests"], 1)
    return {"rps": thr["rps"], "main_thread_cpu_ms_per_request": loop_cpu["main_thread_on_cpu_ms_per_request"],
            "main_thread_busy": loop_cpu["main_thread_busy"], "stub_busy": stub_loop.result(1)["main_thread_busy"],
            "client_busy": client_loop.result(1)["main_thread_busy"],
            # per call, on every CPU and on the CPUs the gateway process may use (all of them unless pinned)
            "interrupt_us_per_request": (irq["irq_s"] + irq["softirq_s"]) * 1e6 / n,
            "ipis_per_request": irq["ipis"] / n, "net_rx_per_request": irq["net_rx"] / n,
            "gateway_cpus_interrupt_us_per_request": (irq_gw["irq_s"] + irq_gw["softirq_s"]) * 1e6 / n,
            "gateway_cpus_ipis_per_request": irq_gw["ipis"] / n}


def round_line(mode: str, got: dict[str, list]) -> str:
    """A round's figures of ``mode`` (the last of each list) as the bench prints them."""
    slow = got["slow"][-1]
    line = f"{mode}: p50 {got['p50_ms'][-1]:.2f} ms, p99 {got['p99_ms'][-1]:.2f} ms"
    if got.get("rps"):
        line += f", {got['rps'][-1]:,.0f} req/s"
    line += f"; {slow['requests']} over {SLOW_MS:g} ms"
    if slow["requests"]:
        line += f" from {slow['first_s']:.2f} to {slow['last_s']:.2f} s"
    warm = got["warm_up"][-1]
    line += f" (warm-up: {warm['requests']}, at most {warm['max_ms']:.1f} ms"
    line += f", loop lag at most {warm['event_loop_lag_max_ms']} ms)" if "event_loop_lag_max_ms" in warm else ")"
    if got.get("gc_collections"):
        line += f", loop lag at most {got['event_loop_lag_max_ms'][-1]} ms, "
        line += (f"{got['gc_collections'][-1]:g} collections of at most {got['gc_pause_max_ms'][-1]} ms"
                 if got["gc_collections"][-1] else "no collection")
    return line


def interleaved_rounds(modes: list[str], rounds: int, stub: subprocess.Popen, stub_url: str, port: int, bootstrap: str,
                       args: argparse.Namespace, procs: list[subprocess.Popen]) -> dict[str, dict[str, list]]:
    """``rounds`` more rounds of every mode, interleaved (their order reversed every other round): each mode's
    open-loop phase (``direct`` too, the round's baseline) and, through a gateway, its closed-loop phase. A
    host's speed drifts between phases by more than logging's cost, and one stall of the host decides a phase's
    p99: so ratios and added latency are taken per round."""
    out: dict[str, dict[str, list]] = {m: collections.defaultdict(list) for m in modes}
    gateway_url = f"http://127.0.0.1:{port}"
    for r in range(rounds):
        for mode in (modes if r % 2 else modes[::-1]):
            with contextlib.ExitStack() as running:
                if mode == "direct":
                    row = open_phase(f"{stub_url}/v1/chat/completions", gateway_url, None, args)
                else:
                    gw, _ = running.enter_context(gateway_for(mode, stub_url, port, bootstrap, args.dashboard_pages,
                                                              procs))
                    url = f"{gateway_url}/v1/chat/completions"
                    row = open_phase(url, gateway_url, gw.pid, args)
                    wait_drained(gateway_url)
                    row.update(closed_phase(url, gw.pid, stub.pid, args))
                    wait_drained(gateway_url)
            for key, value in row.items():
                out[mode][key].append(value)
            print(f"[round {r + 1}] {round_line(mode, out[mode])}", flush=True)
    return {m: dict(v) for m, v in out.items()}


def paired_bursts(pairs: int, seconds: float, stub: subprocess.Popen, stub_url: str, bootstrap: str,
                  args: argparse.Namespace, procs: list[subprocess.Popen]) -> dict[str, object]:
    """``off`` and ``on`` gateways up side by side, then ``pairs`` pairs of closed-loop bursts of ``seconds``
    each, one per gateway, in ABBA order. A host's speed drifts over tens of seconds by more than logging
    costs (per-round ratios of one run spread 0.56-1.04), so the ratio is also taken within each pair, a few
    seconds apart. The idle gateway costs the other nothing: ``on``'s records are drained after each of its
    bursts, before ``off``'s starts. Per burst also the event loop's CPU per call and busy share, and the
    stub's and this client's loops' busy share."""
    from streamrl.broker.embedded import free_port

    got: dict[str, dict[str, list[float]]] = {m: collections.defaultdict(list) for m in ("off", "on")}
    with contextlib.ExitStack() as running:
        gateways = {}
        for mode in got:
            port = free_port()
            gw, _ = running.enter_context(gateway_for(mode, stub_url, port, bootstrap, args.dashboard_pages, procs))
            gateways[mode] = (f"http://127.0.0.1:{port}", gw.pid)
        for url, _ in gateways.values():  # each warmed at full load once
            asyncio.run(closed_loop(f"{url}/v1/chat/completions", args.concurrency, WARM_S, REQUEST))
            wait_drained(url)
        for i in range(pairs):
            for mode in (("off", "on") if i % 2 else ("on", "off")):
                url, pid = gateways[mode]
                loop, stub_loop, client_loop = ThreadCpu(pid), ThreadCpu(stub.pid), ThreadCpu(os.getpid())
                burst = asyncio.run(closed_loop(f"{url}/v1/chat/completions", args.concurrency, seconds, REQUEST))
                cpu = loop.result(burst["requests"])
                for key, value in (("rps", burst["rps"]), ("busy", cpu["main_thread_busy"]),
                                   ("cpu_ms_per_request", cpu["main_thread_on_cpu_ms_per_request"]),
                                   ("stub_busy", stub_loop.result(1)["main_thread_busy"]),
                                   ("client_busy", client_loop.result(1)["main_thread_busy"])):
                    got[mode][key].append(value)
                wait_drained(url)
    ratios = np.divide(got["on"]["rps"], got["off"]["rps"])
    out: dict[str, object] = {
        "pairs": pairs, "seconds": seconds, **{m: dict(v) for m, v in got.items()}, "on_over_off": list(ratios),
        "on_over_off_median": float(np.median(ratios)),
        "on_over_off_quartiles": [float(q) for q in np.percentile(ratios, [25, 75])],
        "cpu_per_request_on_over_off_median": float(np.median(np.divide(got["on"]["cpu_ms_per_request"],
                                                                        got["off"]["cpu_ms_per_request"])))}
    medians = {m: {k: float(np.median(v)) for k, v in got[m].items()} for m in got}
    print(f"[pairs] on / off, {pairs} pairs of {seconds:g} s bursts: median {out['on_over_off_median']:.2f} "
          f"(quartiles {out['on_over_off_quartiles'][0]:.2f}-{out['on_over_off_quartiles'][1]:.2f}); medians of "
          + "; ".join(f"{m}: {v['rps']:,.0f} req/s, loop {v['cpu_ms_per_request']:.3f} ms per call, busy "
                      f"{v['busy']:.0%}, stub / client busy {v['stub_busy']:.0%} / {v['client_busy']:.0%}"
                      for m, v in medians.items()), flush=True)
    return out


def first_pass_round(entry: dict[str, object]) -> dict[str, list[float]]:
    """A mode's figures of the full pass, as the first of its rounds."""
    lat = entry["latency"]
    got: dict[str, list[float]] = {"p50_ms": [lat["p50_ms"]], "p99_ms": [lat["p99_ms"]],
                                   "failures": [lat["failures"]], "host_steal_s": [lat["host"]["host_steal_s"]],
                                   "slow": [lat["slow"]], "warm_up": [lat["warm_up"]]}
    if "rps" in entry["throughput"] and "event_loop_lag" in lat:  # a gateway mode
        got["main_thread_run_delay_ms"] = [lat["threads"]["main_thread_run_delay_s"] * 1000]
        got["event_loop_lag_max_ms"] = [lat["event_loop_lag"]["max_ms"]]
        got["rps"] = [entry["throughput"]["rps"]]
        got["main_thread_cpu_ms_per_request"] = [entry["throughput"]["threads"]["main_thread_on_cpu_ms_per_request"]]
        got["main_thread_busy"] = [entry["throughput"]["threads"]["main_thread_busy"]]
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rate", type=float, default=500)
    p.add_argument("--seconds", type=float, default=10)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--stream-rate", type=float, default=20, help="open-loop rate for the streaming run (0: skip)")
    p.add_argument("--modes", default="direct,off,on,on-framed,on-json,on-dashboard",
                   help="direct, off and on are always run (the summary's baselines)")
    p.add_argument("--dashboard-pages", type=int, default=2, help="open dashboard pages in the on-dashboard mode")
    p.add_argument("--rounds", type=int, default=2,
                   help="more rounds of every mode after the full pass, interleaved: open-loop latency and "
                        "closed-loop req/s, for per-round ratios and added latency")
    p.add_argument("--pairs", type=int, default=0,
                   help="then off and on side by side: this many pairs of closed-loop bursts, on / off per pair")
    p.add_argument("--pair-seconds", type=float, default=2.0, help="each burst of --pairs")
    p.add_argument("--gateway-cpus", help="the -pinned modes' gateway process on these CPUs only (a taskset list, "
                                          "e.g. 0-1), its record producer, the stub, the broker and the load on "
                                          "the others")
    p.add_argument("--serve-stub", type=int, help=argparse.SUPPRESS)
    p.add_argument("--poll-dashboard", help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--vllm", help="also measure record bytes per token on real completions of this vLLM server")
    args = p.parse_args()
    if args.serve_stub:
        serve_stub(args.serve_stub)
        return
    if args.poll_dashboard:
        poll_dashboard(args.poll_dashboard, args.dashboard_pages)
        return
    modes = ["direct", "off", "on", *(m for m in GATEWAY_MODES[2:] if m in args.modes.split(","))]
    if any(m.endswith("-pinned") for m in modes) != bool(args.gateway_cpus):
        raise SystemExit("the -pinned modes and --gateway-cpus go together")
    if args.gateway_cpus:
        global PINNED
        gateway_cpus = cpu_list(args.gateway_cpus)
        others = set(os.sched_getaffinity(0)) - gateway_cpus
        if not others or not shutil.which("taskset"):
            raise SystemExit("--gateway-cpus needs taskset and must leave CPUs for everything else")
        os.sched_setaffinity(0, others)  # inherited by the stub and the broker spawned below
        PINNED = gateway_cpus, others

    from streamrl.broker.embedded import EmbeddedBroker, free_port
    from streamrl.broker.topics import Topics

    results: dict[str, object] = {**stamp(),
                                  "rate": args.rate, "seconds": args.seconds, "gateway_cpus": args.gateway_cpus}
    stub_port, gw_port = free_port(), free_port()
    stub = _spawn([sys.executable, __file__, "--serve-stub", str(stub_port)], "stub")
    broker = EmbeddedBroker(topics=Topics("bench")).start()
    procs = [stub]
    try:
        stub_url = f"http://127.0.0.1:{stub_port}"
        _wait_http(f"{stub_url}/health")
        for mode in modes:
            with contextlib.ExitStack() as running:
                if mode == "direct":
                    url, gw, pages = f"{stub_url}/v1/chat/completions", None, None
                else:
                    gw, pages = running.enter_context(gateway_for(mode, stub_url, gw_port, broker.bootstrap_servers,
                                                                  args.dashboard_pages, procs))
                    url = f"http://127.0.0.1:{gw_port}/v1/chat/completions"
                results[mode] = measure_mode(mode, url, gw, pages, stub, args)
                print(f"[{mode}] {json.dumps(results[mode])}", flush=True)
        extra = interleaved_rounds(modes, args.rounds, stub, stub_url, gw_port, broker.bootstrap_servers, args, procs)
        results["rounds"] = {}
        for m in modes:
            first = first_pass_round(results[m])
            results["rounds"][m] = {k: [*first.get(k, []), *extra[m].get(k, [])] for k in {**first, **extra[m]}}
        if args.pairs:
            results["paired"] = paired_bursts(args.pairs, args.pair_seconds, stub, stub_url,
                                              broker.bootstrap_servers, args, procs)
        results["records"] = record_sizes(broker.bootstrap_servers)
    finally:
        for proc in procs:
            _stop(proc)
        broker.stop()

    if args.vllm:
        results["vllm_records"] = vllm_record_sizes(args.vllm)
    d, off, on = results["direct"], results["off"], results["on"]  # type: ignore[index]
    summary = {}
    for mode, entry in ((m, results[m]) for m in modes if m != "direct"):
        summary[mode] = {
            "added_p50_ms": entry["latency"]["p50_ms"] - d["latency"]["p50_ms"],
            "added_p99_ms": entry["latency"]["p99_ms"] - d["latency"]["p99_ms"],
            "max_rps": entry["throughput"]["rps"],
            "gateway_cpu_ms_per_request": entry["throughput"]["cpu_ms_per_request"],
            "producer_process_cpu_ms_per_request": entry["throughput"]["producer_process_cpu_ms_per_request"],
        }
        lat_threads, thr_threads = entry["latency"]["threads"], entry["throughput"]["threads"]
        summary[mode].update({
            "latency_main_thread_cpu_ms_per_request": lat_threads["main_thread_cpu_ms_per_request"],
            "latency_other_threads_cpu_ms_per_request": lat_threads["other_threads_cpu_ms_per_request"],
            "throughput_main_thread_cpu_ms_per_request": thr_threads["main_thread_cpu_ms_per_request"],
            "throughput_other_threads_cpu_ms_per_request": thr_threads["other_threads_cpu_ms_per_request"],
            "event_loop_lag": entry["latency"].get("event_loop_lag"),
        })
        if entry.get("producer"):  # how often the pipe to the producer process was full, per phase
            summary[mode]["records_waited"] = {"latency": entry["latency"].get("records_waited"),
                                               "throughput": entry["throughput"].get("records_waited")}
        if "stream_latency" in entry:
            summary[mode]["stream_added_p50_ms"] = entry["stream_latency"]["p50_ms"] - d["stream_latency"]["p50_ms"]
            summary[mode]["stream_added_p99_ms"] = entry["stream_latency"]["p99_ms"] - d["stream_latency"]["p99_ms"]
    summary["direct_max_rps"] = d["throughput"]["rps"]
    summary["direct_large_body_p50_p99_ms"] = (d["large_body_latency"]["p50_ms"], d["large_body_latency"]["p99_ms"])
    summary["on_over_off_throughput"] = on["throughput"]["rps"] / off["throughput"]["rps"]
    rounds = results["rounds"]  # type: ignore[index]
    rps = {m: v["rps"] for m, v in rounds.items() if m != "direct"}
    summary["rounds"] = len(rps["off"])
    summary["rps_median"] = {m: float(np.median(v)) for m, v in rps.items()}
    for mode in (m for m in rps if m not in ("off", "on")):
        summary[f"{mode}_over_on_throughput_median"] = float(np.median(np.divide(rps[mode], rps["on"])))
    for mode in (m for m in rps if m not in ("off", "on")):
        summary[f"{mode}_over_off_throughput_median"] = float(np.median(np.divide(rps[mode], rps["off"])))
    summary["on_over_off_throughput_per_round"] = list(np.divide(rps["on"], rps["off"]))
    summary["on_over_off_throughput_median"] = float(np.median(summary["on_over_off_throughput_per_round"]))
    if "on-pinned" in rps and "off-pinned" in rps:
        summary["pinned_on_over_off_throughput_per_round"] = list(np.divide(rps["on-pinned"], rps["off-pinned"]))
        summary["pinned_on_over_off_throughput_median"] = float(
            np.median(summary["pinned_on_over_off_throughput_per_round"]))
    summary["main_thread_cpu_ms_per_request_median"] = {
        m: float(np.median(rounds[m]["main_thread_cpu_ms_per_request"])) for m in rps}
    for mode in rps:  # added latency per round: the mode's percentile minus direct's in the same round
        for q in ("p50", "p99"):
            added = list(np.subtract(rounds[mode][f"{q}_ms"], rounds["direct"][f"{q}_ms"]))
            summary[mode][f"added_{q}_ms_per_round"] = added
            summary[mode][f"added_{q}_ms_median"] = float(np.median(added))
    if "on-json" in results:
        summary["on_json_over_off_throughput"] = results["on-json"]["throughput"]["rps"] / off["throughput"]["rps"]
    if "on-dashboard" in results:  # the dashboard's cost: on with pages open against on, same run
        dash = results["on-dashboard"]
        summary["on_dashboard_over_on_throughput"] = dash["throughput"]["rps"] / on["throughput"]["rps"]
        summary["on_dashboard_minus_on_p50_p99_ms"] = (dash["latency"]["p50_ms"] - on["latency"]["p50_ms"],
                                                       dash["latency"]["p99_ms"] - on["latency"]["p99_ms"])
    if "paired" in results:
        summary["paired_on_over_off_median"] = results["paired"]["on_over_off_median"]
        summary["paired_on_over_off_quartiles"] = results["paired"]["on_over_off_quartiles"]
        summary["paired_cpu_per_request_on_over_off_median"] = results["paired"]["cpu_per_request_on_over_off_median"]
    results["summary"] = summary
    print(json.dumps(results, indent=2))
    print_table(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
