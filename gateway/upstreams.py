"""The pool of vLLM upstreams: who is healthy, what each serves, and which one takes the next request.

A request goes to the healthy upstream with the fewest requests in flight that serves the requested
engine-side model. A background task checks ``/health`` and ``/v1/models`` of every upstream. One that
refuses connections (to a check or a request) leaves the rotation at once; one that answers slowly or
with an error leaves it after ``eject_after`` checks in a row, so that a busy engine (or a gateway whose
event loop lags under overload) does not take the only upstream out for one late answer. It returns
when a check passes again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import aiohttp
import orjson

from streamrl.engine.wire import FORMAT_VERSION, PROBE_PATH

log = logging.getLogger(__name__)


class Upstream:
    """One vLLM server as the gateway sees it."""

    __slots__ = ("adapters", "base_models", "deferred_capture", "failed_checks", "healthy", "in_flight", "last_check",
                 "last_error", "model_cards", "models", "token_capture", "url")

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

    def serves(self, model: str) -> bool:
        return model in self.adapters or model in self.models

    def state(self) -> dict[str, Any]:
        return {"url": self.url, "healthy": self.healthy, "in_flight": self.in_flight,
                "models": self.base_models, "adapters": sorted(self.adapters), "last_error": self.last_error,
                "token_capture": None if self.token_capture is None else "json" if not self.token_capture
                else "engine, deferred" if self.deferred_capture else "engine"}


class UpstreamPool:
    def __init__(self, urls: tuple[str, ...], *, interval_s: float = 1.0, timeout_s: float = 2.0,
                 eject_after: int = 2, token_capture: bool = True, deferred_capture: bool = True) -> None:
        self.upstreams = [Upstream(u) for u in urls]
        self.token_capture = token_capture
        """Ask each upstream whether it offers the engine's token capture (off: always the JSON path)."""
        self.deferred_capture = deferred_capture
        """Use deferred capture where an upstream offers it (``GatewayConfig.deferred_capture``)."""
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
                capture = deferred = False
                if self.token_capture:
                    async with self._session.get(f"{up.url}{PROBE_PATH}", timeout=timeout) as r:
                        probe = orjson.loads(await r.read()) if r.status == 200 else {}
                        capture = probe.get("format") == FORMAT_VERSION
                        deferred = capture and self.deferred_capture and probe.get("deferred") is True
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
            up.token_capture, up.deferred_capture = capture, deferred
            log.info("upstream %s in rotation (models %s; tokens %s)", up.url, up.base_models,
                     "as arrays from the engine" + (", deferred" if deferred else "") if capture
                     else "from its JSON (plain vLLM path)")
            up.healthy = True
            for callback in self.on_recovered:
                callback(up)
