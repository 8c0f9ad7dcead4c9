"""Typed configuration of the gateway. One dataclass; the CLI and tests build it, nothing reads dicts."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from streamrl.broker.schema import check_policy, policy_names
from streamrl.broker.security import OptionalKafkaSettings
from streamrl.config_file import load_config
from streamrl.gateway.recording.kafka_producers import PRODUCER_CLIENTS, ProducerClient

UpdateMode = Literal["pinned", "in-flight"]
UPDATE_MODES: tuple[str, ...] = get_args(UpdateMode)
InFlightCache = Literal["keep", "recompute"]
IN_FLIGHT_CACHES: tuple[str, ...] = get_args(InFlightCache)


@dataclass(frozen=True, slots=True)
class GatewayKafka(OptionalKafkaSettings):
    """The gateway's Kafka table: no broker turns logging off (the overhead benchmark's baseline; the CLI asks
    for ``--no-logging`` to say so)."""


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    upstreams: tuple[str, ...]
    """vLLM OpenAI base URLs, without ``/v1``."""
    host: str = "127.0.0.1"
    port: int = 8080
    policy_name: str = "policy"
    """The stable model name clients use for the policy being trained (the default one, with ``policies``)."""
    policies: tuple[str, ...] = ()
    """More policy names served from the same upstreams (``policy_name`` is always one; ``--policies a,b``):
    each has its own versions, hot-swap, coordination and ``max_loaded_versions``; a request's ``model``
    picks the policy."""
    max_loaded_versions: int = 3
    """At most this many policy versions stay loaded in each upstream."""
    keep_previous_versions: int = 1
    """Versions before the routed one that stay loaded while idle, so that a request pinned to a recent
    version (``policy@v<N>``: a held-out evaluation, an agent finishing an episode on the version it
    began with) still finds it; older ones are unloaded once idle. At most ``max_loaded_versions - 2``
    (the routed version and the next one being loaded need their places)."""
    pinned_hold_s: float = 5.0
    """A version stays held this long after a request pinned to it (``policy@v<N>``) ended, unless the request's
    episode ends first (its reward, ``POST /v1/trajectories/end``): the next call of an episode pinned to it (a
    held-out evaluation of an agent, an agent finishing on the version it began with) finds it even once newer
    versions have retired it. Held versions take the places ``keep_previous_versions`` keeps first; 0: held only
    while requests run on it."""
    follow_policy: bool = True
    """Follow the policy topic and hot-swap published versions (needs ``kafka.bootstrap_servers``)."""
    policy_catch_up_s: float = 10.0
    """At start, wait at most this long to route the latest published version before serving."""
    max_body_bytes: int = 16 << 20
    upstream_timeout_s: float = 600.0
    """A request that gets no (further) bytes from its upstream for this long ends in 504."""
    shutdown_grace_s: float = 10.0
    """On stop (SIGTERM, Ctrl-C), how long calls in flight may run on before they are cut; then what was logged
    is delivered. Without a bound one stuck call would keep the gateway, and its records, from ever stopping."""
    connect_timeout_s: float = 2.0
    """Seconds for an upstream to take a connection. Nothing was sent when it does not: the request is tried
    again, and a second timeout excludes that upstream for the request."""
    health_interval_s: float = 1.0
    health_timeout_s: float = 2.0
    health_failures_to_eject: int = 2
    """Slow or failing health checks in a row before an upstream leaves the rotation (a refused
    connection takes it out at once)."""
    upstream_keepalive_s: float = 4.0
    """Idle connections to upstreams are closed after this: below vLLM's own keep-alive (5 s), so that a
    request rarely goes out on a connection the server is closing at that moment."""
    max_buffered_records: int = 100_000
    max_buffered_bytes: int = 256 << 20
    """Bound in bytes of the records waiting for the producer process (a record can carry a 100 KB body)."""
    producer_send_timeout_ms: int = 10_000
    producer_client: ProducerClient = "librdkafka"
    """The Kafka client the records and rewards are sent through: ``librdkafka`` (confluent-kafka: its C threads
    take about 0.4x the CPU per record of ``kafka-python``'s, docs/benchmarks.md) or ``kafka-python``."""
    spool_dir: str | None = None
    """Directory of the spool: records (``completions/``) and rewards (``rewards/``) wait there, on disk,
    while Kafka cannot take them, and are delivered in order once it can, also by the next gateway
    started on the same directory (after a crash). None: ``<temp dir>/streamrl-spool-<port>``; give a
    directory on a persistent disk in production."""
    spool_max_bytes: int = 1 << 30
    """Bound of each spool (completions, rewards) in bytes; beyond it records are dropped, counted, and
    ``/health`` says ``spool_full``."""
    spool_after_ms: int = 2_000
    """A record not acknowledged by Kafka after this long sends it, and every record after it, to the
    spool (Kafka slow or down). Also about the longest a ``POST /v1/rewards`` waits before its rewards
    are fsynced in the spool instead."""
    producer_process: bool = True
    """Run the Kafka client and record encoding in a child process, off the event loop's GIL."""
    token_capture: bool = True
    """Take token ids and logprobs from the capture frame of upstreams that offer it (``streamrl engine``);
    off, every upstream is asked for them in its JSON, as a plain vLLM is."""
    deferred_capture: bool = True
    """Non-streamed calls to upstreams that offer it: their captures come to the record producer on the
    upstream's capture stream, not through the event loop in the answer (``gateway/recording/capture_stream.py``)."""
    update_mode: UpdateMode = "pinned"
    """What a new version does to requests already running: ``pinned``, they finish on the version they started
    on; ``in-flight``, requests routed by the policy's name move to it from their next decode step on (an
    engine started by ``streamrl engine`` only; requests pinned to ``<name>@v<N>`` never move), and their records
    say which tokens which version sampled (``version_spans``; docs/gateway.md, "In-flight updates")."""
    in_flight_cache: InFlightCache = "keep"
    """In the ``in-flight`` update mode, what a moving request's KV cache does: ``keep``, the tokens so far keep
    the cache computed under the older adapter (PipelineRL's choice, no extra work); ``recompute``, the engine
    computes it again under the new adapter at the move, so later tokens are sampled exactly as a request of the
    new version would sample them (AReaL's choice; a re-prefill per move). docs/gateway.md, "In-flight updates"."""
    deferred_capture_wait_s: float = 30.0
    """How long a call's record waits in the producer for its deferred capture before it is counted invalid."""
    record_request: bool = True
    """Keep the request (messages/prompt, tools, sampling params) in each record for inspection."""
    load_retry_s: float = 1.0
    """Pause before retrying an adapter load that failed on an upstream."""
    extra_headers: dict[str, str] = field(default_factory=dict)
    """Headers sent to every upstream (e.g. an API key)."""
    api_keys: str | None = None
    """File of the API keys clients must send (``Authorization: Bearer KEY``), one ``KEY SCOPES [ID]`` a line,
    scopes among inference, rewards, admin (docs/gateway.md, "Authentication"). None: the keys in the
    environment variable STREAMRL_API_KEYS, else no keys are checked (allowed on a loopback address only)."""
    insecure: bool = False
    """Serve without API keys on an address other hosts can reach (refused otherwise)."""
    adapter_root: str | None = None
    """Policy records whose adapter directory (or a file in it, symlinks followed) resolves outside this
    directory are refused. None: any path (``streamrl up`` sets its trainer's adapter directory)."""
    trusted_publishers: tuple[str, ...] = ()
    """When given, only policy records whose ``publisher`` is one of these are served (a trainer's
    ``publisher_id``, ``streamrl publish --publisher``)."""
    kafka: GatewayKafka = field(default_factory=GatewayKafka)
    """The Kafka of the gateway's producer and policy consumer: brokers, topic prefix, security."""
    gateway_id: str | None = None
    """This gateway's id on the coordination topic (docs/gateway.md, "Several gateways"); None: host name,
    process id and start time, unique per process (a restarted gateway is a new one)."""
    heartbeat_s: float = 1.0
    """Seconds between two states a gateway writes to the coordination topic (it also writes at once when
    what it routes or uses changes)."""
    gateway_ttl_s: float = 5.0
    """A gateway that has written no state for this long is taken for dead: not waited for before an
    unload, and the next-oldest gateway leads in its place."""
    workers: int = 1
    """Gateway processes ``streamrl gateway`` starts on the same port (``SO_REUSEPORT``: the kernel spreads
    connections among them), each a gateway of its own with its own id, producer and spool directory."""
    dashboard: bool = True
    """Serve the live dashboard at ``/dashboard`` (docs/gateway.md, "Dashboard"); off, nothing is kept for it
    and its routes are absent."""
    dashboard_interval_s: float = 1.0
    """Seconds between the dashboard's samples of the gateway's counters (throughput, records, health)."""

    @property
    def policy_names(self) -> tuple[str, ...]:
        """Every policy served, ``policy_name`` first."""
        return (self.policy_name, *dict.fromkeys(p for p in self.policies if p != self.policy_name))

    def __post_init__(self) -> None:
        if not self.upstreams:
            raise ValueError("at least one upstream is required")
        if self.max_loaded_versions < 2:  # the routed version plus the next one being loaded
            raise ValueError("max_loaded_versions must be >= 2")
        if not 0 <= self.keep_previous_versions <= self.max_loaded_versions - 2:
            raise ValueError(f"keep_previous_versions must be between 0 and max_loaded_versions - 2 "
                             f"({self.max_loaded_versions - 2}), not {self.keep_previous_versions}")
        if not 0 <= self.pinned_hold_s <= 600:
            raise ValueError(f"pinned_hold_s must be between 0 and 600 seconds, not {self.pinned_hold_s}")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be >= 1024")
        if self.health_failures_to_eject < 1:
            raise ValueError("health_failures_to_eject must be >= 1")
        if self.dashboard_interval_s <= 0:
            raise ValueError("dashboard_interval_s must be > 0")
        if self.upstream_keepalive_s <= 0:
            raise ValueError("upstream_keepalive_s must be > 0")
        if self.spool_max_bytes < 1 << 20:
            raise ValueError("spool_max_bytes must be >= 1 MiB")
        if not 0 < self.heartbeat_s < self.gateway_ttl_s:
            raise ValueError("heartbeat_s must be > 0 and below gateway_ttl_s")
        if self.workers < 1:
            raise ValueError("workers must be >= 1")
        if self.shutdown_grace_s <= 0:
            raise ValueError("shutdown_grace_s must be > 0")
        if self.spool_after_ms < 1:
            raise ValueError("spool_after_ms must be >= 1")
        if self.update_mode not in UPDATE_MODES:
            raise ValueError(f"update_mode must be one of {', '.join(UPDATE_MODES)}, not {self.update_mode!r}")
        if self.update_mode == "in-flight" and not self.token_capture:
            raise ValueError("update_mode 'in-flight' needs token_capture: an engine says which tokens moved to which "
                             "version in its capture frames, which a gateway without token capture does not ask for "
                             "(docs/gateway.md, \"In-flight updates\")")
        if self.in_flight_cache not in IN_FLIGHT_CACHES:
            raise ValueError(f"in_flight_cache must be one of {', '.join(IN_FLIGHT_CACHES)}, "
                             f"not {self.in_flight_cache!r}")
        if self.producer_client not in PRODUCER_CLIENTS:
            raise ValueError(f"producer_client must be one of {', '.join(PRODUCER_CLIENTS)}, not {self.producer_client!r}")
        object.__setattr__(self, "upstreams", tuple(u.rstrip("/") for u in self.upstreams))
        object.__setattr__(self, "trusted_publishers", tuple(self.trusted_publishers))
        object.__setattr__(self, "policies", policy_names(self.policies))
        check_policy(self.policy_name)
        object.__setattr__(self, "kafka", GatewayKafka.of(self.kafka))

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> GatewayConfig:
        """Defaults, then the file (TOML or JSON; a ``[gateway]`` table is used if present), then the
        overrides whose value is not None."""
        return load_config(cls, path, "gateway", overrides)

    @property
    def spool_path(self) -> Path:
        return Path(self.spool_dir) if self.spool_dir else Path(tempfile.gettempdir()) / f"streamrl-spool-{self.port}"

    @property
    def logging_enabled(self) -> bool:
        return self.kafka.bootstrap_servers is not None
