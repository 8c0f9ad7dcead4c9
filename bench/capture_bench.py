"""What capturing tokens costs vLLM's generation: every way of asking for them, against one engine, in one run.

One ``streamrl engine`` (with its capture middleware) serves every mode in turn, each the same load:
``--requests`` chat requests of ``--max-tokens`` generated tokens (``ignore_eos``), ``--concurrency`` in
flight, each with its own prompt. Modes:

  chat               plain chat, nothing extra (the baseline: what a user gets from vLLM)
  chat-ids           + ``return_token_ids``
  chat-logprobs-ids  + ``logprobs`` + ``return_token_ids`` (what the gateway asks a plain vLLM for)
  completions-ids    ``/v1/completions``, token-id prompt, ``logprobs: 0``, ``return_token_ids``
  generate           ``/inference/v1/generate`` with ``logprobs: 1`` (skipped where the engine lacks it)
  chat-capture       plain chat with the gateway's ``X-Streamrl-Capture`` header: vLLM's bytes + a capture frame
  gateway            plain chat through ``streamrl gateway``, logging on (capture frames, records to Kafka)
  gateway-json       the same with ``--no-token-capture`` (the gateway asks for logprobs + ids in the JSON)
  gateway-stream     streamed chat through the gateway, logging on (capture frames)
  chat-stream        streamed chat straight to vLLM (the baseline of gateway-stream)
  chat-again         plain chat once more (drift of the engine over the run)

Reported per mode: completion tokens/s and its ratio to ``chat``, response bytes on the wire per
completion token and, where a capture frame came, its bytes per token. A check scores the first
``--check-requests`` captured replies with the engine's ``prompt_logprobs`` and reports how far the captured
logprobs are from the engine's own for those tokens (``teacher_forced``). With
``--rounds`` N the modes run N times in turn (the engine's speed drifts over a run; interleaving spreads
the drift over every mode), each round starting one mode further down the list (so that no mode always
follows the same one), and each mode reports the median of its rounds and the median of its ratios to
``chat`` in the same round (paired). Each run also reads from /proc the CPU time of the engine's processes
(and of the gateway's) per 1,000 completion tokens, and the engine core's busy-loop thread's own CPU time
and wait for a CPU: that thread bounds generation here, so its CPU per token is capture's cost to the
engine without the time a neighbour held its core (reported beside it, with the thread's busy share; a
slower core still shows). ``--py-spy SECONDS`` samples
the engine's processes (API server and engine core, ``py-spy record --subprocesses``) for that long
during each listed mode's last round, into ``--out``/py-spy-MODE.txt (collapsed stacks). ``--py-spy-core``
instead samples the engine core process alone (Python frames; native ones would stop it at every sample), in
every round, and reports per mode the median over rounds of each function's CPU ms per 1,000 tokens (``core_profile``):
the same round's chat is the baseline, so what capture adds to the thread that bounds generation shows by
function, whatever the host's speed that round.

    python bench/capture_bench.py --shape qwen2.5-1.5b [--requests 1024 --concurrency 256 --max-tokens 256]
    python bench/capture_bench.py --model DIR ...        (an existing checkpoint)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson
from harness import stamp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

MODES = ("chat", "chat-ids", "chat-logprobs-ids", "completions-ids", "generate", "chat-capture", "gateway",
         "gateway-json", "gateway-stream", "chat-stream", "chat-again")


def prompt_messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Request {i}: write a long story about a lighthouse keeper."}]


class Load:
    """One mode's requests, ``concurrency`` at a time, counting tokens and bytes."""

    def __init__(self, args: argparse.Namespace, model: str, prompt_ids: list[list[int]]) -> None:
        self.args, self.model, self.prompt_ids = args, model, prompt_ids

    def request(self, mode: str, i: int) -> tuple[str, dict[str, Any], dict[str, str]]:
        a = self.args
        sampling = {"max_tokens": a.max_tokens, "temperature": 1.0, "ignore_eos": True, "seed": i}
        chat = {"model": self.model, "messages": prompt_messages(i), **sampling}
        headers: dict[str, str] = {}
        if mode in ("chat", "chat-again", "gateway", "gateway-json"):
            return "chat", chat, headers
        if mode in ("chat-stream", "gateway-stream"):
            return "chat", chat | {"stream": True, "stream_options": {"include_usage": True}}, headers
        if mode == "chat-ids":
            return "chat", chat | {"return_token_ids": True}, headers
        if mode == "chat-logprobs-ids":
            return "chat", chat | {"logprobs": True, "return_token_ids": True}, headers
        if mode == "chat-capture":
            from streamrl.engine.wire import CAPTURE_HEADER

            return "chat", chat, {CAPTURE_HEADER: "1"}
        if mode == "completions-ids":
            return "completions", {"model": self.model, "prompt": self.prompt_ids[i], "logprobs": 0,
                                   "return_token_ids": True, **sampling}, headers
        if mode == "generate":
            return "generate", {"model": self.model, "token_ids": self.prompt_ids[i],
                                "sampling_params": {**sampling, "logprobs": 1}}, headers
        raise ValueError(mode)

    async def run(self, mode: str, base_url: str, engine_url: str | None = None) -> dict[str, Any]:
        """One mode's load; with ``engine_url``, the engine's running requests are sampled meanwhile (a
        mode that keeps fewer requests in the engine than the load sends shows it here)."""
        from streamrl.engine.wire import CAPTURE_HEADER, capture_counts, unframe

        a = self.args
        paths = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
                 "generate": "/inference/v1/generate"}
        tokens = body_bytes = capture_bytes = failures = 0
        errors: dict[str, int] = {}
        captures: dict[int, bytes] = {}
        latencies: list[float] = []
        running: list[float] = []
        queue = iter(range(a.requests))
        timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
            async def worker() -> None:
                nonlocal tokens, body_bytes, capture_bytes, failures
                for i in queue:
                    kind, body, headers = self.request(mode, i)
                    sent = time.perf_counter()
                    try:
                        async with session.post(base_url + paths[kind], data=orjson.dumps(body),
                                                headers={"Content-Type": "application/json", **headers}) as r:
                            raw = await r.read()
                            status, framed = r.status, r.headers.get(CAPTURE_HEADER) == "1"
                    except aiohttp.ClientError as exc:
                        status, raw, framed = f"{type(exc).__name__}: {exc}"[:120], b"", False
                    latencies.append(time.perf_counter() - sent)
                    if status != 200:
                        failures += 1
                        errors[str(status)] = errors.get(str(status), 0) + 1
                        continue
                    if framed:
                        raw, capture = unframe(raw)
                        capture_bytes += len(capture or b"")
                        if capture is not None and i < a.check_requests:
                            captures[i] = capture
                        tokens += capture_counts(capture)[2] if capture else 0
                    else:
                        tokens += completion_tokens(kind, raw, body.get("stream", False))
                    body_bytes += len(raw)

            async def sample_running() -> None:
                while True:
                    await asyncio.sleep(0.25)
                    async with session.get(f"{engine_url}/metrics") as r:
                        running.append(running_requests(await r.text()))

            async def engine_e2e() -> tuple[float, float]:
                async with session.get(f"{engine_url}/metrics") as r:
                    return histogram_totals(await r.text(), "vllm:e2e_request_latency_seconds")

            async def watch_loop() -> None:  # this process's own event loop: a late client is not a slow engine
                # (on the 2-core box vLLM's CPU worker held both cores for seconds: a round's wave of requests
                # then left this process late and ran into the engine's keep-alive; see client_run_delay_s)
                while True:
                    before = time.perf_counter()
                    await asyncio.sleep(0.01)
                    late = time.perf_counter() - before - 0.01
                    stalls[0] = max(stalls[0], late)
                    stalls[1] += late if late > 0.1 else 0.0

            from gateway_bench import processes_run_delay_s

            me = [os.getpid()]
            delay0 = processes_run_delay_s(me)
            cpu0 = time.process_time()
            stalls = [0.0, 0.0]
            watcher = asyncio.ensure_future(watch_loop())
            sampler = asyncio.ensure_future(sample_running()) if engine_url else None
            e2e_before = await engine_e2e() if engine_url else (0.0, 0.0)
            started = time.perf_counter()
            await asyncio.gather(*(worker() for _ in range(a.concurrency)))
            seconds = time.perf_counter() - started
            watcher.cancel()
            waited = processes_run_delay_s(me) - delay0
            used = time.process_time() - cpu0
            if sampler is not None:
                sampler.cancel()
                e2e_after = await engine_e2e()
                done = e2e_after[1] - e2e_before[1]
                engine_latency = (e2e_after[0] - e2e_before[0]) / done if done else None
        lat = np.asarray(latencies) if latencies else np.zeros(1)
        out = {"requests": a.requests, "failures": failures, "errors": errors, "seconds": seconds,
               "client_loop_max_late_s": stalls[0], "client_loop_late_s": stalls[1],
               "client_run_delay_s": waited, "client_cpu_s": used,
               "completion_tokens": tokens, "tokens_per_s": tokens / seconds,
               "bytes_per_token": body_bytes / max(tokens, 1),
               "latency_s": {"mean": float(lat.mean()), "p50": float(np.percentile(lat, 50)),
                             "p99": float(np.percentile(lat, 99))}}
        if running:
            out["engine_running_mean"] = float(np.mean(running))
        if engine_url:
            out["latency_s"]["engine_e2e_mean"] = engine_latency  # in the engine: what the client saw, less HTTP
        if capture_bytes:
            out["capture_bytes_per_token"] = capture_bytes / max(tokens, 1)
        out["_captures"] = captures
        return out


def metric_sum(metrics: str, name: str) -> float:
    """The sum of a Prometheus sample over its series (e.g. ``vllm:num_requests_running``, or a
    histogram's ``..._sum`` / ``..._count``), read with prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for family in text_string_to_metric_families(metrics) for s in family.samples
               if s.name == name)


def histogram_totals(metrics: str, name: str) -> tuple[float, float]:
    """A Prometheus histogram's ``_sum`` and ``_count`` summed over its series."""
    return metric_sum(metrics, name + "_sum"), metric_sum(metrics, name + "_count")


def running_requests(metrics: str) -> float:
    """``vllm:num_requests_running`` summed over its series, from the engine's Prometheus text."""
    return metric_sum(metrics, "vllm:num_requests_running")


def completion_tokens(kind: str, raw: bytes, stream: bool) -> int:
    if stream:  # the usage chunk (stream_options.include_usage) comes last before [DONE]
        last = [e for e in raw.split(b"\n\n") if e.startswith(b"data: {")][-1]
        return int(orjson.loads(last[6:])["usage"]["completion_tokens"])
    body = orjson.loads(raw)
    if kind == "generate":
        return sum(len(c.get("token_ids") or ()) for c in body.get("choices", ()))
    return int(body["usage"]["completion_tokens"])


def teacher_forced(captures: dict[int, bytes], engine_url: str, model: str) -> dict[str, Any]:
    """The captured logprobs against the engine's own for the same tokens: each captured reply is sent back
    as a prompt (its prompt ids, then its sampled ids) with ``prompt_logprobs``, which gives the model's
    logprob of every one of those tokens. Unlike comparing with a second sampled request, this holds when
    the sampled tokens differ from run to run (seeded sampling on a GPU depends on the batch); with the
    bench's temperature 1 and no top-k/top-p, the sampling distribution is the model's. A capture that put
    a step's logprobs on the wrong request or token would be off by nats, batch-order noise by hundredths."""
    import httpx

    from streamrl.engine.wire import decode_capture

    diffs: list[np.ndarray] = []
    for raw in captures.values():
        [c] = decode_capture(raw)
        prompt = [int(t) for t in c.prompt_token_ids]
        sampled = [int(t) for t in c.token_ids]
        r = httpx.post(f"{engine_url}/v1/completions", timeout=120,
                       json={"model": model, "prompt": prompt + sampled, "max_tokens": 1, "temperature": 1.0,
                             "prompt_logprobs": 0})
        r.raise_for_status()
        entries = r.json()["choices"][0]["prompt_logprobs"][len(prompt):]
        forced = np.asarray([e[str(t)]["logprob"] for e, t in zip(entries, sampled, strict=True)], np.float32)
        diffs.append(np.abs(c.logprobs - forced))
    every = np.concatenate(diffs) if diffs else np.zeros(0, np.float32)
    return {"replies": len(diffs), "tokens": int(every.size),
            "max_abs_diff": float(every.max()) if every.size else None,
            "mean_abs_diff": float(every.mean()) if every.size else None}


def spawn_gateway(upstream: str, bootstrap: str, port: int, json_path: bool, log_dir: Path) -> Any:
    cmd = [sys.executable, "-m", "streamrl.cli", "--log-level", "WARNING", "gateway", "--upstream", upstream,
           "--bootstrap-servers", bootstrap, "--port", str(port), "--topic-prefix", "capture-bench"]
    if json_path:
        cmd.append("--no-token-capture")
    log = open(log_dir / f"gateway{'-json' if json_path else ''}.log", "wb")  # noqa: SIM115
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """A mode's figures over its rounds: the last round's details, the median speed and CPU per token, every
    round's speed, failures and its engine core's wait for a CPU (a failure in any round must show)."""
    speeds = [r["tokens_per_s"] for r in rounds]
    cpu = {k: float(np.median([r["cpu_ms_per_1k_tokens"][k] for r in rounds]))
           for k in rounds[-1].get("cpu_ms_per_1k_tokens", {})}
    last = {k: v for k, v in rounds[-1].items() if not k.startswith("_")}  # per-round internals stay out
    return {**last, "tokens_per_s": float(np.median(speeds)), "rounds_tokens_per_s": speeds,
            "cpu_ms_per_1k_tokens": cpu,
            "rounds_engine_core_run_delay_s": [r.get("engine_core_run_delay_s") for r in rounds],
            "failures": sum(r["failures"] for r in rounds), "rounds_errors": [r["errors"] for r in rounds],
            "rounds_host": [r.get("host") for r in rounds], "rounds_placement": [r.get("placement") for r in rounds],
            "rounds_engine_core_thread_cpu_ms_per_1k": [r["cpu_ms_per_1k_tokens"].get("engine_core_thread")
                                                         for r in rounds]}


class ProcessCpu:
    """CPU seconds the engine's processes (API server, engine core) and a gateway's (with its producer
    process) spend in one mode's run, and how long the engine core's thread waited for a CPU. The engine
    core's thread is what bounds generation here, so its CPU per token is what capture costs it, without
    the time a neighbour held the core (run delay, which tokens/s includes)."""

    def __init__(self, processes: dict[str, list[int]], core_pid: int | None) -> None:
        from gateway_bench import host_cpu_counters

        self.processes, self.core_pid = processes, core_pid
        self.before = self.sample()
        self.host0 = host_cpu_counters()
        self.placement = Placement(core_pid, processes.get("api_server", [None])[0]) if core_pid else None

    def sample(self) -> dict[str, float]:
        from gateway_bench import cpu_seconds, run_delay_seconds, thread_cpu

        def cpu(pid: int) -> float:
            try:
                return cpu_seconds(pid)
            except (OSError, IndexError, ValueError):  # gone
                return 0.0

        out = {name: sum(cpu(pid) for pid in pids) for name, pids in self.processes.items()}
        if self.core_pid is not None:  # its main thread: the busy loop
            out["engine_core_thread"] = thread_cpu(self.core_pid).get(self.core_pid, 0.0)
            out["engine_core_run_delay"] = run_delay_seconds(self.core_pid, self.core_pid)
        return out

    def result(self, tokens: int, seconds: float) -> dict[str, Any]:
        from gateway_bench import counters_delta, host_cpu_counters

        after = self.sample()
        host = counters_delta(self.host0, host_cpu_counters())
        used = {k: after[k] - self.before[k] for k in after}
        per_1k = 1000 / max(tokens, 1)
        out: dict[str, Any] = {"cpu_ms_per_1k_tokens": {name: used[name] * 1000 * per_1k for name in self.processes}}
        if self.core_pid is not None:
            out["cpu_ms_per_1k_tokens"]["engine_core_thread"] = used["engine_core_thread"] * 1000 * per_1k
            out["engine_core_thread_busy"] = used["engine_core_thread"] / seconds
            out["engine_core_run_delay_s"] = used["engine_core_run_delay"]
        out["host"] = {k: round(v, 3) for k, v in host.items() if k in ("host_steal_s", "cpu_pressure_some_s",
                                                                          "cgroup_throttled_s")}
        if self.placement is not None:
            out["placement"] = self.placement.stop()
        return out


def cpu_nodes() -> dict[int, int]:
    """Each CPU's NUMA node (all on node 0 where sysfs has no nodes)."""
    from gateway_bench import cpu_list

    nodes = {}
    for node in Path("/sys/devices/system/node").glob("node[0-9]*"):
        with contextlib.suppress(OSError, ValueError):
            for cpu in cpu_list((node / "cpulist").read_text()):
                nodes[cpu] = int(node.name[4:])
    return nodes or dict.fromkeys(range(os.cpu_count() or 1), 0)


def gpu_local_cpus() -> set[int]:
    """The CPUs sysfs names local to the first visible GPU (its PCI device's ``local_cpulist``); none if unknown."""
    from gateway_bench import cpu_list

    with contextlib.suppress(OSError, ValueError, subprocess.SubprocessError, IndexError):
        bus = subprocess.run(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.split()[0].lower()
        return cpu_list(Path(f"/sys/bus/pci/devices/{bus[-12:]}/local_cpulist").read_text())
    return set()


def topology() -> dict[str, Any]:
    """What the machine's CPUs are, for reading placement: NUMA nodes, SMT siblings, the GPU's local CPUs."""
    from gateway_bench import smt_siblings

    nodes = cpu_nodes()
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "")
    return {"cpus": len(nodes), "nodes": {str(n): sorted(c for c, m in nodes.items() if m == n) for n in set(nodes.values())},
            "smt_sibling_sets": smt_siblings(), "gpu_local_cpus": sorted(gpu_local_cpus()), "cpu_model": model,
            "affinity": sorted(os.sched_getaffinity(0))}


class Placement:
    """Which CPU the engine core's busy-loop thread (and the API server's main thread) ran on, sampled every
    20 ms over a round (``processor`` of /proc/PID/task/TID/stat): a round whose thread sat on a slower CPU,
    another NUMA node than the GPU's, or one CPU with the API server shows here."""

    def __init__(self, core_pid: int, api_pid: int | None) -> None:
        self.core_pid, self.api_pid = core_pid, api_pid
        self.core: dict[int, int] = {}
        self.shared = self.samples = self.migrations = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _cpu(pid: int) -> int | None:
        with contextlib.suppress(OSError, IndexError, ValueError):
            return int(Path(f"/proc/{pid}/task/{pid}/stat").read_text().rsplit(")", 1)[1].split()[36])
        return None

    def _run(self) -> None:
        last = None
        while not self._stop.wait(0.02):
            cpu = self._cpu(self.core_pid)
            if cpu is None:
                continue
            self.samples += 1
            self.core[cpu] = self.core.get(cpu, 0) + 1
            self.migrations += last is not None and cpu != last
            last = cpu
            self.shared += self.api_pid is not None and self._cpu(self.api_pid) == cpu

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        nodes = cpu_nodes()
        by_node: dict[str, int] = {}
        for cpu, n in self.core.items():
            by_node[str(nodes.get(cpu, -1))] = by_node.get(str(nodes.get(cpu, -1)), 0) + n
        return {"samples": self.samples, "engine_core_cpus": {str(c): n for c, n in sorted(self.core.items())},
                "engine_core_nodes": by_node, "migrations": self.migrations, "same_cpu_as_api_server": self.shared}


def engine_core_pid(api_server_pid: int) -> int | None:
    """The engine core: the API server's child process whose command line vLLM names ``VLLM::EngineCore``."""
    from gateway_bench import children

    for pid in children(api_server_pid):
        try:
            if b"EngineCore" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
        except OSError:
            continue
    return None


def baseline_mode(modes: dict[str, Any], mode: str) -> str:
    """What a mode is compared with: ``chat-stream`` for ``gateway-stream`` where it ran, else ``chat``."""
    return "chat-stream" if mode == "gateway-stream" and "chat-stream" in modes else "chat"


def paired_ratios(modes: dict[str, dict[str, Any]], mode: str, base: str | None = None) -> list[float]:
    """A mode's speed over ``base``'s (default its baseline) in each round: the drift between rounds cancels
    out of these."""
    ref = modes.get(base or baseline_mode(modes, mode), {})
    pairs = zip(modes[mode].get("rounds_tokens_per_s", ()), ref.get("rounds_tokens_per_s", ()), strict=False)
    return [speed / ref_speed for speed, ref_speed in pairs if ref_speed > 0]


def start_py_spy(pid: int, args: argparse.Namespace, name: str, *, alone: bool = False,
                 seconds: float | None = None) -> tuple[subprocess.Popen, Path]:
    """Sample a process and its children (the engine's API server and core; the gateway and its record
    producer) for ``--py-spy`` seconds; ``alone``: that process only. Never with native frames: py-spy
    takes those only by stopping the process at every sample, which would change what is measured."""
    out = args.out / f"py-spy-{name}.txt"
    beside = Path(sys.executable).parent / "py-spy"  # installed into the venv that runs this, not on PATH
    cmd = [shutil.which("py-spy") or str(beside), "record", "--pid", str(pid), *([] if alone else ["--subprocesses"]),
           "--nonblocking", "--rate", "100", "--duration", str(int(seconds or args.py_spy)),
           "--format", "raw", "--output", str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT), out


def finish_py_spy(profiler: tuple[subprocess.Popen, Path], *, stop: bool = False) -> dict[str, Any]:
    """Wait for py-spy to write its file (``stop``: end its sampling now; py-spy writes what it has on SIGINT)."""
    proc, out = profiler
    if stop and proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        log = proc.communicate(timeout=120)[0].decode(errors="replace")
    except subprocess.TimeoutExpired:
        proc.kill()
        log = "py-spy did not finish"
    return {"file": str(out), "exit": proc.returncode, "log": log[-2000:]}


def function_samples(raw: Path) -> tuple[dict[str, int], int]:
    """Inclusive samples per function (``name (file)``, line numbers dropped) of py-spy's collapsed stacks,
    and the samples in all."""
    counts: dict[str, int] = {}
    total = 0
    for line in raw.read_text(errors="replace").splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        total += int(n)
        seen = {re.sub(r":\d+\)$", ")", frame) for frame in stack.split(";")}
        for frame in seen:
            counts[frame] = counts.get(frame, 0) + int(n)
    return counts, total


def core_profile(rounds: list[dict[str, Any]], base_rounds: list[dict[str, Any]], top: int = 40) -> list[dict]:
    """A mode's engine-core functions by CPU ms per 1,000 tokens (median over rounds), beside the same rounds'
    baseline mode, the functions whose cost per token differs most first. A function's share of the round's
    samples (py-spy leaves out idle ones) times the engine core's CPU per 1,000 tokens from /proc: what it costs,
    whether or not the profiler was attached for the whole round."""
    def per_1k(r: dict[str, Any]) -> dict[str, float]:
        total, cpu = r.get("_core_total", 0), r["cpu_ms_per_1k_tokens"].get("engine_core", 0.0)
        return {f: n / total * cpu for f, n in r.get("_core_samples", {}).items()} if total else {}

    mine, base = [per_1k(r) for r in rounds], [per_1k(r) for r in base_rounds]
    names = {f for d in mine + base for f in d}
    rows = []
    for f in names:
        a = float(np.median([d.get(f, 0.0) for d in mine])) if mine else 0.0
        b = float(np.median([d.get(f, 0.0) for d in base])) if base else 0.0
        rows.append({"function": f, "cpu_ms_per_1k_tokens": round(a, 2),
                     "baseline_cpu_ms_per_1k_tokens": round(b, 2)})
    rows.sort(key=lambda r: -abs(r["cpu_ms_per_1k_tokens"] - r["baseline_cpu_ms_per_1k_tokens"]))
    return rows[:top]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a checkpoint directory (default: build a random one of --shape)")
    p.add_argument("--shape", default="qwen2.5-1.5b")
    p.add_argument("--requests", type=int, default=1024)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--check-requests", type=int, default=16)
    p.add_argument("--engine-args", default="", help="extra vLLM flags")
    p.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "capture-bench")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--rounds", type=int, default=1, help="run the modes this many times in turn; report medians")
    p.add_argument("--py-spy", type=float, default=0.0, metavar="SECONDS",
                   help="profile the engine during each mode's last round (needs py-spy on the PATH)")
    p.add_argument("--engine-cpus", default="", metavar="CPUS",
                   help="pin vLLM's processes to these CPUs (a kernel CPU list, or gpu-local: the GPU's NUMA-local "
                        "CPUs), this client, the broker and the gateways to the others")
    p.add_argument("--py-spy-core", action="store_true",
                   help="profile the engine core alone in every round; per-token comparison with chat")
    args = p.parse_args()

    import httpx
    from gateway_bench import _stop, _wait_http, children, cpu_list, histogram_buckets, histogram_summary

    from streamrl.broker.embedded import EmbeddedBroker, free_port
    from streamrl.broker.topics import Topics
    from streamrl.engine.server import Engine, EngineConfig

    args.out.mkdir(parents=True, exist_ok=True)
    if args.model is None:
        from streamrl.tiny_model import build_model

        model_dir = args.out / f"model-{args.shape}"
        if not (model_dir / "config.json").exists():
            build_model(model_dir, args.shape, seed=0)
        args.model = str(model_dir)
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()},
                               **stamp(), "modes": {}}
    engine = Engine(EngineConfig(model=args.model, max_model_len=2048, max_loras=2,
                                 extra_args=args.engine_args.split()), log_file=args.out / "engine.log")
    results["topology"] = topology()
    everything = os.sched_getaffinity(0)
    engine_cpus = (gpu_local_cpus() if args.engine_cpus == "gpu-local" else cpu_list(args.engine_cpus)) & everything
    if engine_cpus:  # vLLM's processes inherit it; what starts after the engine gets the rest
        os.sched_setaffinity(0, engine_cpus)
    results["engine_cpus"] = sorted(engine_cpus)
    started = time.monotonic()
    engine.start(timeout=900)
    if engine_cpus and everything - engine_cpus:
        os.sched_setaffinity(0, everything - engine_cpus)
    results["engine_start_s"] = time.monotonic() - started
    import vllm

    results["vllm"] = vllm.__version__
    broker = EmbeddedBroker(topics=Topics("capture-bench")).start()
    gateways: dict[str, Any] = {}
    try:
        served = httpx.get(f"{engine.url}/v1/models").json()["data"][0]["id"]
        prompt_ids = [httpx.post(f"{engine.url}/tokenize", json={"model": served, "messages": prompt_messages(i),
                                                                 "add_generation_prompt": True}).json()["tokens"]
                      for i in range(args.requests)]
        load = Load(args, served, prompt_ids)
        modes = args.modes.split(",")
        for name, json_path in (("gateway", False), ("gateway-json", True)):
            if name in modes or (name == "gateway" and "gateway-stream" in modes):
                port = free_port()
                gateways[name] = (spawn_gateway(engine.url, broker.bootstrap_servers, port, json_path, args.out),
                                  f"http://127.0.0.1:{port}")
                _wait_http(f"http://127.0.0.1:{port}/health", timeout=60)
        print("warming up ...", flush=True)
        asyncio.run(load.run("chat", engine.url))
        for name, (_, url) in gateways.items():  # the gateways' first calls (connections, producer) too
            asyncio.run(load.run(name, url))
        core = engine_core_pid(engine.proc.pid)
        rounds: dict[str, list[dict[str, Any]]] = {}
        for round_ in range(args.rounds):
            turn = round_ % len(modes)
            for mode in modes[turn:] + modes[:turn]:
                url = gateways["gateway" if mode == "gateway-stream" else mode][1] if mode.startswith("gateway") \
                    else engine.url
                if mode == "generate":
                    _, body, _ = load.request("generate", 0)
                    probe = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=120)
                    if probe.status_code != 200:
                        results["modes"][mode] = {"skipped": f"{probe.status_code}: {probe.text[:200]}"}
                        print(f"[{mode}] skipped ({probe.status_code})", flush=True)
                        continue
                profile = bool(args.py_spy) and round_ == args.rounds - 1
                profilers = [start_py_spy(engine.proc.pid, args, mode)] if profile else []
                core_spy = start_py_spy(core, args, f"core-{mode}-{round_}", alone=True, seconds=3600) \
                    if args.py_spy_core and core else None
                if profile and mode.startswith("gateway"):
                    gateway = gateways["gateway" if mode == "gateway-stream" else mode][0]
                    profilers.append(start_py_spy(gateway.pid, args, f"{mode}-gateway"))
                lag_before = histogram_buckets(url) if mode.startswith("gateway") else None
                processes = {"api_server": [engine.proc.pid], "engine_core": [core] if core else []}
                if mode.startswith("gateway"):
                    gateway_pid = gateways["gateway" if mode == "gateway-stream" else mode][0].pid
                    processes["gateway"] = [gateway_pid, *children(gateway_pid)]
                cpu = ProcessCpu(processes, core)
                r = asyncio.run(load.run(mode, url, engine.url))
                r.update(cpu.result(r["completion_tokens"], r["seconds"]))
                if profilers:
                    r["py_spy"] = [finish_py_spy(p) for p in profilers]
                if core_spy is not None:
                    spy = finish_py_spy(core_spy, stop=True)
                    raw = Path(spy["file"])
                    r["_core_samples"], r["_core_total"] = function_samples(raw) if raw.exists() else ({}, 0)
                    if not r["_core_total"]:
                        r["core_py_spy"] = spy
                if lag_before is not None:  # the gateway's own event loop: how late its 5 ms timer ran
                    r["gateway_event_loop_lag"] = histogram_summary(lag_before, histogram_buckets(url))
                captures = r.pop("_captures")
                if captures:
                    try:  # a check that fails must not cost the run its figures
                        r["check"] = teacher_forced(captures, engine.url, served)
                    except (httpx.HTTPError, KeyError, TypeError, ValueError) as exc:
                        r["check"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                if mode.startswith("gateway"):
                    r["gateway_health"] = httpx.get(f"{url}/health").json()
                rounds.setdefault(mode, []).append(r)
                results["modes"][mode] = median_round(rounds[mode])
                cpu_line = ", ".join(f"{k} {v:.0f}" for k, v in r["cpu_ms_per_1k_tokens"].items())
                print(f"[{mode}] {r['tokens_per_s']:,.0f} tok/s, {r['bytes_per_token']:.1f} B/token, "
                      f"latency mean {r['latency_s']['mean']:.2f} s (engine "
                      f"{r['latency_s'].get('engine_e2e_mean') or float('nan'):.2f} s), engine running "
                      f"{r.get('engine_running_mean', float('nan')):.0f}, {r['failures']} failed; CPU ms per 1k "
                      f"tokens: {cpu_line}; engine core busy {r.get('engine_core_thread_busy', float('nan')):.0%}, "
                      f"waited for a CPU {r.get('engine_core_run_delay_s', float('nan')):.2f} s"
                      f"; steal {r['host'].get('host_steal_s', float('nan')):.2f} s, core thread on "
                      f"{json.dumps(r.get('placement', {}).get('engine_core_nodes'))} (nodes), "
                      f"{r.get('placement', {}).get('migrations', 0)} moves"
                      f"; this client's loop late {r['client_loop_late_s']:.2f} s (at most {r['client_loop_max_late_s']:.2f}), "
                      f"its CPU {r['client_cpu_s']:.2f} s, waited for a CPU {r['client_run_delay_s']:.2f} s"
                      f"{'; errors ' + json.dumps(r['errors']) if r['errors'] else ''}", flush=True)
    finally:
        for proc, _ in gateways.values():
            _stop(proc)
        broker.stop()
        engine.stop()
    base = results["modes"].get("chat", {}).get("tokens_per_s")
    stream_base = results["modes"].get("chat-stream", {}).get("tokens_per_s")
    base_core = results["modes"].get("chat", {}).get("cpu_ms_per_1k_tokens", {}).get("engine_core_thread")
    print("\n| mode | completion tokens/s | vs plain chat | same round (median) | engine core thread CPU ms per 1k "
          "tokens (vs chat) | bytes per token (body / capture) | failed |")
    print("| --- | ---: | ---: | ---: | --- | --- | ---: |")
    for mode, r in results["modes"].items():
        if "skipped" in r:
            print(f"| {mode} | skipped | | | | | |")
            continue
        ref_tps = stream_base if mode == "gateway-stream" and stream_base else base
        r["vs_plain_chat"] = r["tokens_per_s"] / ref_tps if ref_tps else None
        paired = paired_ratios(results["modes"], mode)
        if paired:
            r["rounds_vs_plain_chat"], r["vs_plain_chat_paired"] = paired, float(np.median(paired))
        cap = f" / {r['capture_bytes_per_token']:.1f}" if "capture_bytes_per_token" in r else ""
        same = f"{r['vs_plain_chat_paired']:.2f}x" if "vs_plain_chat_paired" in r else ""
        core_ms = r.get("cpu_ms_per_1k_tokens", {}).get("engine_core_thread")
        core = f"{core_ms:.0f} ({core_ms / base_core:.2f}x)" if core_ms and base_core else ""
        print(f"| {mode} | {r['tokens_per_s']:,.0f} | {r['vs_plain_chat']:.2f}x | {same} | {core} | "
              f"{r['bytes_per_token']:.1f}{cap} | {r['failures']} |")
    if args.py_spy_core:
        for mode, mode_rounds in rounds.items():
            if mode != "chat":
                rows = core_profile(mode_rounds, rounds.get("chat", []))
                results["modes"][mode]["core_profile"] = rows
                print(f"\n[{mode}] engine core CPU ms per 1k tokens by function against chat's, largest differences:")
                for row in rows[:15]:
                    print(f"  {row['cpu_ms_per_1k_tokens']:7.2f} vs {row['baseline_cpu_ms_per_1k_tokens']:7.2f}  "
                          f"{row['function'][:110]}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
