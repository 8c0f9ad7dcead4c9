"""Prometheus metrics of one gateway (its own registry, so several gateways can live in one process)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from streamrl.gateway.recording.log_producer import ProducerStats

from .loop_lag import LAG_BUCKETS, CollectionPauses
from .upstreams import UpstreamPool

SWAP_BUCKETS = (0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 4, 5,
                10, 30)
"""Publish to routed takes 0.1-0.5 s with an eager engine on the CPU and 1.5-2.5 s on a GPU with CUDA
graphs (LoRA load ~1.4 s): buckets fine enough for both."""
REJECT_REASONS = ("sha256", "outside_root", "publisher", "malformed")
"""Why a policy record was refused (``hotswap.py``)."""
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class _CollectionCollector(Collector):
    """The process's garbage-collection pauses by generation (``loop_lag.CollectionPauses``)."""

    def __init__(self, pauses: CollectionPauses) -> None:
        self.pauses = pauses

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily("streamrl_gateway_gc_pause_seconds", "how long each garbage collection of "
                                       "the gateway process held the GIL (the event loop waits it out)",
                                       labels=["generation"])
        for generation in range(3):
            buckets, total = self.pauses.buckets(generation)
            family.add_metric([str(generation)], buckets, total)
        yield family


class TokenCounts(Collector):
    """Tokens of logged completions: plain integers that the event loop adds to on every logged call and a
    scrape reads (a prometheus ``Counter.inc`` takes a lock and checks its type each time: two per call were a
    sixth of logging's own work on the event loop, docs/gateway.md "How it keeps overhead low")."""

    def __init__(self) -> None:
        self.prompt = self.completion = 0

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily("streamrl_gateway_tokens", "tokens seen in logged completions", labels=["kind"])
        family.add_metric(["prompt"], self.prompt)
        family.add_metric(["completion"], self.completion)
        yield family


class _StateCollector(Collector):
    """Reads live state at scrape time: upstreams, producer counters, policy version."""

    def __init__(self, pool: UpstreamPool, stats: Callable[[], ProducerStats | None],
                 buffered: Callable[[], int], policy_version: Callable[[], dict[str, int]],
                 reward_stats: Callable[[], ProducerStats | None]) -> None:
        self.pool, self.stats, self.buffered, self.policy_version = pool, stats, buffered, policy_version
        self.reward_stats = reward_stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        up = GaugeMetricFamily("streamrl_gateway_upstream_healthy", "1 if the upstream is in rotation",
                               labels=["upstream"])
        inflight = GaugeMetricFamily("streamrl_gateway_upstream_in_flight", "requests in flight per upstream",
                                     labels=["upstream"])
        short = GaugeMetricFamily("streamrl_gateway_upstream_lora_slots_short", "1 if the upstream has fewer LoRA "
                                  "slots than this gateway's policies need (or LoRA off), 0 if enough; absent "
                                  "while unknown (an engine whose probe does not say)", labels=["upstream"])
        moved = CounterMetricFamily("streamrl_gateway_upstream_moved_requests", "requests the upstream moved to a "
                                    "newer version while they ran, by that version (in-flight update mode)",
                                    labels=["upstream", "adapter"])
        for u in self.pool.upstreams:
            for version, n in u.moved.items():
                moved.add_metric([u.url, version], n)
            up.add_metric([u.url], 1.0 if u.healthy else 0.0)
            inflight.add_metric([u.url], u.in_flight)
            if u.lora["status"] != "unknown":
                short.add_metric([u.url], 0.0 if u.lora["status"] == "ok" else 1.0)
        yield up
        yield inflight
        yield short
        yield moved
        s = self.stats()
        if s is not None:
            records = CounterMetricFamily("streamrl_gateway_records", "records by outcome", labels=["outcome"])
            records.add_metric(["offered"], s.offered)
            records.add_metric(["produced"], s.delivered)
            records.add_metric(["failed"], s.failed)
            records.add_metric(["dropped"], s.dropped)
            records.add_metric(["invalid"], s.invalid)
            yield records
            yield CounterMetricFamily("streamrl_gateway_records_waited",
                                      "records that found the pipe to the producer process full", value=s.waited)
            yield CounterMetricFamily("streamrl_gateway_records_undelivered",
                                      "records offered but not delivered (failed + dropped + dropped by a full spool)", value=s.undelivered)
            yield CounterMetricFamily("streamrl_gateway_record_bytes", "record bytes delivered (before compression)",
                                      value=s.bytes_delivered)
            yield GaugeMetricFamily("streamrl_gateway_records_buffered", "records waiting for the producer",
                                    value=self.buffered())
            yield from _spool_metrics({"completions": s, "rewards": self.reward_stats()})
        version = GaugeMetricFamily("streamrl_gateway_policy_version", "policy version routed for each policy name",
                                    labels=["policy"])
        for name, v in self.policy_version().items():
            version.add_metric([name], v)
        yield version


def _spool_metrics(streams: dict[str, ProducerStats | None]) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """The spools of completions and rewards (``stream`` label)."""
    records = CounterMetricFamily("streamrl_gateway_spool_records", "records through the spool by outcome: "
                                  "spooled (Kafka could not take them), replayed (delivered from the spool), "
                                  "dropped (the spool was full)", labels=["stream", "outcome"])
    waiting = GaugeMetricFamily("streamrl_gateway_spool_waiting", "records in the spool waiting for Kafka",
                                labels=["stream"])
    size = GaugeMetricFamily("streamrl_gateway_spool_bytes", "bytes of the spool on disk", labels=["stream"])
    full = GaugeMetricFamily("streamrl_gateway_spool_full", "1 while the spool refuses records", labels=["stream"])
    for name, s in streams.items():
        if s is None:
            continue
        records.add_metric([name, "spooled"], s.spooled)
        records.add_metric([name, "replayed"], s.replayed)
        records.add_metric([name, "dropped"], s.spool_dropped)
        waiting.add_metric([name], s.spool_records)
        size.add_metric([name], s.spool_bytes)
        full.add_metric([name], float(s.spool_full))
    yield from (records, waiting, size, full)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("streamrl_gateway_requests", "requests by route and status",
                                ["route", "status"], registry=self.registry)
        self.latency = Histogram("streamrl_gateway_request_seconds", "time to the full response by route",
                                 ["route"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.ttft = Histogram("streamrl_gateway_ttft_seconds", "time to first token of streamed responses",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.tokens = TokenCounts()
        self.registry.register(self.tokens)
        self.retries = Counter("streamrl_gateway_upstream_retries", "requests retried on another upstream",
                               registry=self.registry)
        self.slow_strips = Counter("streamrl_gateway_slow_strips",
                                   "response bodies stripped by the msgspec path, not the byte-level one "
                                   "(a vLLM field order this gateway does not know costs CPU, not correctness)",
                                   registry=self.registry)
        self.rewards = Counter("streamrl_gateway_rewards", "rewards (and judge requests) accepted, by the policy they "
                               "name (empty: none named)", ["policy"], registry=self.registry)
        self.policy_requests = Counter("streamrl_gateway_policy_requests", "calls served by a policy (its routed "
                                       "or a pinned version), by policy and status", ["policy", "status"],
                                       registry=self.registry)
        self.swaps = Counter("streamrl_gateway_policy_swaps", "policy versions routed, by policy", ["policy"],
                             registry=self.registry)
        self.policy_rejected = Counter("streamrl_gateway_policy_rejected",
                                       "policy records refused, by reason: sha256 (mismatch or unreadable "
                                       "weights), outside_root (adapter path leaves adapter_root), publisher "
                                       "(not a trusted publisher), malformed (undecodable)",
                                       ["reason"], registry=self.registry)
        for reason in REJECT_REASONS:  # exported at 0 from the start, so that an alert can watch them
            self.policy_rejected.labels(reason)
        self.adapter_load_failures = Counter("streamrl_gateway_adapter_load_failures",
                                             "failed adapter loads into an upstream (retried)",
                                             registry=self.registry)
        self.adapter_loads = Counter("streamrl_gateway_adapter_loads",
                                     "adapter loads this gateway asked of an upstream, by answer: loaded (the "
                                     "upstream loaded it), already (it had it: a dead leader's load finished)",
                                     ["answer"], registry=self.registry)
        self.leader = Gauge("streamrl_gateway_leader", "1 while this gateway leads the gateways of the policy "
                            "(it loads and unloads its adapters for all of them)", ["policy"], registry=self.registry)
        self.info = Gauge("streamrl_gateway_info", "1, labelled with this gateway process's id on the "
                          "coordination topic (each of N processes on one port answers /metrics for itself)",
                          ["gateway_id"], registry=self.registry)
        self.publish_to_route = Histogram("streamrl_gateway_publish_to_route_seconds",
                                          "from a version's publication to the policy name routed to it",
                                          ["policy"], buckets=SWAP_BUCKETS, registry=self.registry)
        self.route_announcements = Counter("streamrl_gateway_route_announcements",
                                           "in the in-flight update mode, engines told that a newly routed "
                                           "version is routed (a one-token marked request: their running "
                                           "requests move to it at the next step)", ["policy"],
                                           registry=self.registry)
        self.loop_lag = Histogram("streamrl_gateway_event_loop_lag_seconds",
                                  "how late a timer on the event loop ran (stalls every request waits behind)",
                                  buckets=LAG_BUCKETS, registry=self.registry)

    def watch(self, pool: UpstreamPool, stats: Callable[[], ProducerStats | None], buffered: Callable[[], int],
              policy_version: Callable[[], dict[str, int]], reward_stats: Callable[[], ProducerStats | None]) -> None:
        self.registry.register(_StateCollector(pool, stats, buffered, policy_version, reward_stats))

    def watch_collections(self, pauses: CollectionPauses) -> None:
        self.registry.register(_CollectionCollector(pauses))

    def observe(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route, str(status)).inc()
        self.latency.labels(route).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
