"""The pool of vLLM upstreams: who is healthy, what each serves, and which one takes the next request.

A request goes to the healthy upstream with the fewest requests in flight that serves the requested
engine-side model. A background task checks ``/health`` and ``/v1/models`` of every upstream. One that
refuses connections (to a check or a request) leaves the rotation at once; one that answers slowly or
with an error leaves it after ``eject_after`` checks in a row, so that a busy engine (or a gateway whose
event loop lags under overload) does not take the only upstream out for one late answer. It returns
when a check passes again.

Each time an upstream comes into rotation its capture probe (``GET /streamrl/capture``) says how it hands over
tokens and how many LoRA slots it has; ``lora_check`` holds those against what this gateway's policies need
(``engine/lora_slots.py``). Too few is a warning and a field of ``/health``, not a reason to leave it out
(docs/gateway.md, "Several policies on one gateway": vLLM serves on, its loads evict each other).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import aiohttp
import orjson

from streamrl.engine.lora_slots import FLAGS, lora_slots
from streamrl.engine.wire import FORMAT_VERSION, PROBE_PATH, SPANS_FORMAT_VERSION

log = logging.getLogger(__name__)

NOT_REPORTED = object()
"""``lora_check``'s argument when the probe has no ``lora`` key (an older engine, a plain vLLM, no probe)."""


def lora_check(lora: Any, needs: tuple[int, int]) -> dict[str, Any]:
    """An upstream's LoRA slots as its capture probe reports them (``lora``: ``{"max_loras", "max_cpu_loras",
    "max_lora_rank"}``, None with LoRA off, ``NOT_REPORTED``) against ``needs`` (``lora_slots``: (max_loras,
    max_cpu_loras)); what ``/health`` shows of them: ``status`` is ``ok``, ``too_few`` (either count below what
    is needed), ``off`` (it cannot load an adapter at all) or ``unknown`` (not reported), with the counts it has
    and ``needs``."""
    need = {"max_loras": needs[0], "max_cpu_loras": needs[1]}
    if lora is None:
        return {"status": "off", "needs": need}
    keys = ("max_loras", "max_cpu_loras", "max_lora_rank")
    if not isinstance(lora, dict) or not all(type(lora.get(k)) is int for k in keys):
        return {"status": "unknown", "needs": need}
    short = any(lora[k] < n for k, n in need.items())
    return {"status": "too_few" if short else "ok", **{k: lora[k] for k in keys}, "needs": need}


def lora_warning(url: str, state: dict[str, Any], policies: int, max_loaded_versions: int) -> str | None:
    """The warning an upstream's LoRA slots (``lora_check``) call for, naming the counts it has, those needed
    and the vLLM flags to restart it with; None when it has enough or did not say."""
    need = state["needs"]
    flags = " ".join(f"{FLAGS[k]} {n}" for k, n in need.items())
    served = f"this gateway's {policies} polic{'ies' if policies > 1 else 'y'} x max_loaded_versions " \
             f"{max_loaded_versions}"
    if state["status"] == "off":
        return (f"upstream {url} has LoRA off: it serves the base model only, and no version of a policy can be "
                f"loaded into it. Restart it with --enable-lora {flags} (what {served} need)")
    if state["status"] != "too_few":
        return None
    has = ", ".join(f"{FLAGS[k]} {state[k]}" + (f" (needs {n})" if state[k] < n else "") for k, n in need.items())
    return (f"upstream {url} has too few LoRA slots for {served}: {has}. It serves on, but the versions loaded "
            f"into it evict each other (each eviction reloads an adapter from disk between two engine steps, and "
            f"a version kept for pinned requests may be the one evicted; with too few GPU slots the first requests "
            f"of a new version wait in the engine until an older version's last reply ends). Restart it with "
            f"{flags}, or lower max_loaded_versions")


class Upstream:
    """One vLLM server as the gateway sees it."""

    __slots__ = ("adapters", "base_models", "deferred_capture", "failed_checks", "healthy", "in_flight", "last_check",
                 "last_error", "lora", "lora_warned", "model_cards", "models", "moved", "moves_requests", "pinned_warned",
                 "token_capture", "url")

    def __init__(self, url: str) -> None:
        self.url = url
        self.healthy = False
        self.in_flight = 0
        self.models: set[str] = set()
        """Every model id the upstream lists (base models and loaded adapters)."""
        self.base_models: list[str] = []
        self.model_cards: list[dict[str, Any]] = []
        self.adapters: set[str] = set()
        """Adapters the gateway loaded into it (kept by the policy follower)."""
        self.last_error = ""
        self.last_check = 0.0
        self.failed_checks = 0
        """Health checks failed in a row (timeouts, error statuses)."""
        self.token_capture: bool | None = None
        """Whether it hands over tokens as arrays (``streamrl engine``) or only in its JSON (a plain vLLM);
        asked each time it comes into rotation, ``None`` until then."""
        self.deferred_capture = False
        """It queues non-streamed calls' captures for the record producer's stream (probe: ``deferred``)."""
        self.moves_requests = False
        """It can move a running request to a newer adapter version and say where (probe: capture format 2,
        ``engine/inflight.py``): the gateway's ``in-flight`` update mode asks it to."""
        self.moved: dict[str, int] = {}
        """Requests it moved, by the adapter version they moved to (``<policy>@v<N>``: its probe's
        ``in_flight_moves_to``), read at each health check in the ``in-flight`` update mode."""
        self.lora: dict[str, Any] = {"status": "unknown"}
        """Its LoRA slots against what the gateway's policies need (``lora_check``), asked with the capture
        each time it comes into rotation."""
        self.lora_warned: tuple[Any, ...] | None = None
        """The slots last warned about: the same ones again (a restart, a flap) are not logged again."""
        self.pinned_warned = False
        """In the ``in-flight`` update mode: warned that it cannot move requests (not again until it once could)."""

    def serves(self, model: str) -> bool:
        return model in self.adapters or model in self.models

    def state(self) -> dict[str, Any]:
        return {"url": self.url, "healthy": self.healthy, "in_flight": self.in_flight,
                "models": self.base_models, "adapters": sorted(self.adapters), "last_error": self.last_error,
                "token_capture": None if self.token_capture is None else "json" if not self.token_capture
                else "engine, deferred" if self.deferred_capture else "engine", "lora": self.lora,
                "moves_requests": self.moves_requests,
                **({"in_flight_moves": self.moved} if self.moves_requests else {})}


class UpstreamPool:
    def __init__(self, urls: tuple[str, ...], *, interval_s: float = 1.0, timeout_s: float = 2.0,
                 eject_after: int = 2, token_capture: bool = True, deferred_capture: bool = True,
                 policies: int = 1, max_loaded_versions: int = 3, in_flight: bool = False) -> None:
        self.upstreams = [Upstream(u) for u in urls]
        self.policies, self.max_loaded_versions = policies, max_loaded_versions
        self.lora_needs = lora_slots(policies, max_loaded_versions)
        """(max_loras, max_cpu_loras) each upstream needs for the gateway's policies (``lora_check``)."""
        for up in self.upstreams:
            up.lora = lora_check(NOT_REPORTED, self.lora_needs)
        self.token_capture = token_capture
        """Ask each upstream whether it offers the engine's token capture (off: always the JSON path)."""
        self.deferred_capture = deferred_capture
        """Use deferred capture where an upstream offers it (``GatewayConfig.deferred_capture``)."""
        self.in_flight = in_flight
        """The ``in-flight`` update mode: each health check also reads how many requests each engine moved."""
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.eject_after = eject_after
        self.on_recovered: list[Any] = []
        """Callbacks ``f(upstream)`` run when an upstream comes back (it may have restarted empty)."""
        self._turn = 0
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    # -- routing -------------------------------------------------------------------------------------
    def pick(self, model: str, exclude: tuple[Upstream, ...] = ()) -> Upstream | None:
        """The healthy upstream serving ``model`` with the fewest requests in flight (ties in turn)."""
        best: Upstream | None = None
        ups = self.upstreams
        n = len(ups)
        self._turn = (self._turn + 1) % n
        for i in range(n):
            up = ups[(self._turn + i) % n]
            if up.healthy and up not in exclude and up.serves(model) and (
                    best is None or up.in_flight < best.in_flight):
                best = up
        return best

    def base_models(self) -> list[str]:
        seen: list[str] = []
        for up in self.upstreams:
            for m in up.base_models:
                if m not in seen:
                    seen.append(m)
        return seen

    def known_model(self, model: str) -> bool:
        return any(model in up.models for up in self.upstreams)

    def model_cards(self) -> list[dict[str, Any]]:
        """Base-model cards as the upstreams list them (adapters are the gateway's business)."""
        cards: dict[str, dict[str, Any]] = {}
        for up in self.upstreams:
            for card in up.model_cards:
                if card.get("parent") is None:
                    cards.setdefault(card["id"], card)
        return list(cards.values())

    async def _probe(self, up: Upstream, timeout: aiohttp.ClientTimeout) -> dict[str, Any]:
        """The upstream's capture probe (token capture, LoRA slots), ``{}`` where it has none. With token capture
        on, a probe that fails fails the check (the upstream joins once its capture is known); off, it only
        leaves the LoRA slots unknown."""
        assert self._session is not None
        try:
            async with self._session.get(f"{up.url}{PROBE_PATH}", timeout=timeout) as r:
                return _json_object(await r.read()) if r.status == 200 else {}
        except (aiohttp.ClientError, TimeoutError):
            if self.token_capture:
                raise
            return {}

    def _warn_lora(self, up: Upstream) -> None:
        """Log a warning when the upstream's LoRA slots are too few (or off): once per upstream and slot counts."""
        warning = lora_warning(up.url, up.lora, self.policies, self.max_loaded_versions)
        seen = tuple(sorted((k, v) for k, v in up.lora.items() if k != "needs")) if warning else None
        if warning and seen != up.lora_warned:
            log.warning("%s", warning)
        up.lora_warned = seen

    def _warn_pinned(self, up: Upstream, probe: dict[str, Any]) -> None:
        """In the ``in-flight`` update mode, one WARNING for an upstream that cannot move running requests (a plain
        vLLM, an engine whose capture predates version spans): its requests run pinned, silently otherwise."""
        if not self.in_flight or up.moves_requests:
            up.pinned_warned = False
            return
        if up.pinned_warned:
            return
        if not probe:
            why = "no capture probe: a plain vLLM"
        elif not up.token_capture:
            why = f"its capture is format {probe.get('format')}, not this gateway's {FORMAT_VERSION}"
        else:
            why = (f"its capture lists formats {probe.get('formats') or [probe.get('format')]}, without "
                   f"{SPANS_FORMAT_VERSION}, which says which version sampled which token")
        log.warning("upstream %s cannot move running requests to a newer version (%s): in the in-flight update mode "
                    "its requests run pinned, to the end on the version they started on. Serve it with this "
                    "release's `streamrl engine` (docs/gateway.md, \"In-flight updates\")", up.url, why)
        up.pinned_warned = True

    def mark_failed(self, up: Upstream, error: str) -> None:
        if up.healthy:
            log.warning("upstream %s out of rotation: %s", up.url, error)
        up.healthy = False
        up.last_error = error

    # -- health checks -------------------------------------------------------------------------------
    async def start(self, session: aiohttp.ClientSession) -> None:
        self._session = session
        await self.check_all()
        self._task = asyncio.create_task(self._loop(), name="upstream-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check_all()
            except Exception:  # a bug here must not end health checking
                log.exception("health check round failed")

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(up) for up in self.upstreams))

    async def check(self, up: Upstream) -> None:
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        was_healthy = up.healthy
        try:
            async with self._session.get(f"{up.url}/health", timeout=timeout) as r:
                if r.status != 200:
                    raise RuntimeError(f"/health returned {r.status}")
            async with self._session.get(f"{up.url}/v1/models", timeout=timeout) as r:
                if r.status != 200:
                    raise RuntimeError(f"/v1/models returned {r.status}")
                cards = orjson.loads(await r.read())["data"]
            if not was_healthy:
                probe = await self._probe(up, timeout)
                capture = self.token_capture and probe.get("format") == FORMAT_VERSION
                deferred = capture and self.deferred_capture and probe.get("deferred") is True
                moves = capture and SPANS_FORMAT_VERSION in (probe.get("formats") or ())
            elif self.in_flight and up.moves_requests:
                moved = (await self._probe(up, timeout)).get("in_flight_moves_to")
                up.moved = {str(k): int(v) for k, v in moved.items()} if isinstance(moved, dict) else {}
        except Exception as exc:
            up.failed_checks += 1
            error = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, aiohttp.ClientConnectorError) or up.failed_checks >= self.eject_after \
                    or not was_healthy:
                self.mark_failed(up, error)
            else:
                up.last_error = error
                log.info("upstream %s failed a health check (%s); %d more in a row take it out of rotation",
                         up.url, error, self.eject_after - up.failed_checks)
            return
        finally:
            up.last_check = time.time()
        up.failed_checks = 0
        up.model_cards = cards
        up.models = {c["id"] for c in cards}
        up.base_models = [c["id"] for c in cards if c.get("parent") is None]
        up.last_error = ""
        if not was_healthy:
            up.adapters &= up.models  # it may have restarted and lost what the gateway loaded
            up.token_capture, up.deferred_capture, up.moves_requests = capture, deferred, moves
            up.lora = lora = lora_check(probe.get("lora", NOT_REPORTED), self.lora_needs)
            log.info("upstream %s in rotation (models %s; tokens %s; LoRA slots %s)", up.url, up.base_models,
                     "as arrays from the engine" + (", deferred" if deferred else "") if capture
                     else "from its JSON (plain vLLM path)",
                     f"{lora['max_loras']} GPU, {lora['max_cpu_loras']} CPU, rank {lora['max_lora_rank']}, "
                     f"{lora['status']}" if "max_loras" in lora else lora["status"])
            self._warn_lora(up)
            self._warn_pinned(up, probe)
            up.healthy = True
            for callback in self.on_recovered:
                callback(up)


def _json_object(raw: bytes) -> dict[str, Any]:
    """A probe's answer; anything but a JSON object (a proxy's page, an unrelated server) reads as no probe."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return {}
    return body if isinstance(body, dict) else {}
