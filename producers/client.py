"""A trajectory context for agents that talk to the streamrl gateway with the official OpenAI client.

The gateway learns which calls belong together from two headers, and the trainer learns how good they
were from one reward. This helper does both so an agent's code stays plain OpenAI SDK code::

    with Trajectory("http://127.0.0.1:8080", group_id="task-7", group_size=8) as t:
        reply = t.client.chat.completions.create(model="policy", messages=[...])
        t.reward(1.0)               # posted to POST /v1/rewards when the block ends

``t.client`` is an ``openai.OpenAI`` whose every request carries ``X-Trajectory-Id`` (and ``X-Group-Id``).
A block that raises posts no reward: the trajectory is abandoned and the trainer expires it. A block that
ends with no reward (a held-out evaluation's) tells the gateway the episode ended (``POST
/v1/trajectories/end``), so that a policy version its calls pinned (``policy@v<N>``) is let go at once. Many
trajectories can share one ``Gateway`` (one connection pool) instead of each opening its own.
``AsyncGateway`` / ``AsyncTrajectory`` are the same for ``openai.AsyncOpenAI``.
"""

from __future__ import annotations

import logging
import uuid
from types import TracebackType
from typing import Any

import httpx
import openai
from httpx_aiohttp import HttpxAiohttpClient

from streamrl.broker.schema import PURPOSES, RecordError, judge_request, reward_record

TRAJECTORY_HEADER = "X-Trajectory-Id"
GROUP_HEADER = "X-Group-Id"
VERSION_HEADER = "X-Policy-Version"
PURPOSE_HEADER = "X-Streamrl-Purpose"
"""``eval`` marks a held-out evaluation's calls: recorded, never trained on (default ``train``)."""

log = logging.getLogger(__name__)


class RewardError(RuntimeError):
    """The gateway refused a reward (status and body included): nothing was recorded."""


def _v1(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else f"{url}/v1"


def reward_body(trajectory_id: str, reward: float, group_id: str | None = None, group_size: int | None = None,
                metrics: dict[str, float] | None = None) -> dict[str, Any]:
    """The JSON the gateway's ``POST /v1/rewards`` takes, checked here by the schema's own rules
    (``reward_record``; a ``ValueError``) so a bad reward fails in the agent, where the bug is, rather than
    as a 400 later."""
    body: dict[str, Any] = {"trajectory_id": trajectory_id, "reward": reward}
    if group_id is not None:
        body["group_id"] = group_id
    if group_size is not None:
        body["group_size"] = group_size
    if metrics:
        body["metrics"] = metrics
    checked = reward_record(body)
    body["reward"] = checked.reward
    if metrics:
        body["metrics"] = checked.metrics
    return body


def _check(response: httpx.Response) -> None:
    if response.status_code >= 400:
        raise RewardError(f"POST /v1/rewards -> {response.status_code}: {response.text[:500]}")


def _ended(trajectory_id: str, response: httpx.Response | Exception) -> None:
    """The answer to an episode's end. Not an error the episode fails on: without it the gateway lets the
    version go ``pinned_hold_s`` later (an older gateway has no such route)."""
    if isinstance(response, Exception):
        log.debug("the end of trajectory %s was not sent: %r", trajectory_id, response)
    elif response.status_code >= 400:
        log.debug("the end of trajectory %s was refused: %s %s", trajectory_id, response.status_code,
                  response.text[:200])


def _tag_headers(trajectory_id: str, group_id: str | None, purpose: str) -> dict[str, str]:
    headers = {TRAJECTORY_HEADER: trajectory_id}
    if group_id is not None:
        headers[GROUP_HEADER] = group_id
    if purpose != "train":
        headers[PURPOSE_HEADER] = purpose
    return headers


class _Served:
    """Which policy version served each open trajectory's calls, read from the responses' ``X-Policy-Version``
    by a response hook on the gateway's HTTP client. An agent written with a framework never sees the
    responses' headers; with this its episode still knows the version that played it (``t.version``),
    whatever client the framework builds on the shared HTTP pool."""

    def __init__(self) -> None:
        self.open: dict[str, _Episode] = {}

    def note(self, request_headers: Any, response_headers: Any) -> None:
        episode = self.open.get(request_headers.get(TRAJECTORY_HEADER, ""))
        if episode is None:
            return
        episode.calls += 1
        value = response_headers.get(VERSION_HEADER)
        if value is not None and value.isdigit():
            episode.version = int(value) if episode.version is None else max(episode.version, int(value))

    def sync_hook(self, response: httpx.Response) -> None:
        self.note(response.request.headers, response.headers)

    async def async_hook(self, response: httpx.Response) -> None:
        self.note(response.request.headers, response.headers)


class Gateway:
    """One gateway: a shared OpenAI client and HTTP pool from which trajectories are made."""

    def __init__(self, url: str, *, api_key: str = "unused", timeout: float = 600.0, max_retries: int = 0) -> None:
        self.base_url = _v1(url)
        self.served = _Served()
        self.http = httpx.Client(timeout=timeout, event_hooks={"response": [self.served.sync_hook]})
        self._auth = {"Authorization": f"Bearer {api_key}"}
        """Sent with rewards, as the openai client sends it with completions (a gateway with API keys)."""
        self.openai = openai.OpenAI(base_url=self.base_url, api_key=api_key, http_client=self.http,
                                    max_retries=max_retries)

    def trajectory(self, *, group_id: str | None = None, group_size: int | None = None,
                   trajectory_id: str | None = None, purpose: str = "train") -> Trajectory:
        return Trajectory(self, group_id=group_id, group_size=group_size, trajectory_id=trajectory_id,
                          purpose=purpose)

    def post_rewards(self, bodies: list[dict[str, Any]]) -> None:
        """Post rewards in one request (the gateway takes a list)."""
        _check(self.http.post(f"{self.base_url}/rewards", json=bodies, headers=self._auth))

    def end_trajectories(self, trajectory_ids: list[str]) -> None:
        """Say these episodes ended without a reward (``POST /v1/trajectories/end``); never raises."""
        try:
            response: httpx.Response | Exception = self.http.post(
                f"{self.base_url}/trajectories/end", json={"trajectory_ids": trajectory_ids}, headers=self._auth)
        except httpx.HTTPError as exc:
            response = exc
        _ended(trajectory_ids[0], response)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Gateway:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Episode:
    """What both trajectory flavours share: the ids, the pending reward and its request body."""

    def __init__(self, group_id: str | None, group_size: int | None, trajectory_id: str | None,
                 purpose: str = "train") -> None:
        if purpose not in PURPOSES:
            raise ValueError(f"purpose must be one of {', '.join(PURPOSES)}, not {purpose!r}")
        self.trajectory_id = trajectory_id or uuid.uuid4().hex
        self.group_id = group_id
        self.group_size = group_size
        self.purpose = purpose
        self.headers = _tag_headers(self.trajectory_id, group_id, purpose)
        """The headers that tag a call as this trajectory's: for a framework's own client (``default_headers``,
        ``extra_headers``) where ``client`` cannot be passed."""
        self.version: int | None = None
        """The newest policy version that served a call of this trajectory (inside its ``with`` block, through
        the gateway's HTTP client: ``client``, or a framework's client built on ``http``); None before a call."""
        self.calls = 0
        """Calls of this trajectory answered so far (counted as ``version``)."""
        self._reward: float | None = None
        self._metrics: dict[str, float] = {}
        self._judge: dict[str, Any] | None = None
        self.posted = False

    def reward(self, value: float, **metrics: float) -> None:
        """Set the reward (and optional numeric metrics); it is posted when the block ends."""
        reward_body(self.trajectory_id, value, self.group_id, self.group_size, metrics)  # now, where the bug is
        self._reward = float(value)
        self._metrics = {k: float(v) for k, v in metrics.items()}

    def judge(self, rubric: str | None = None, *, weight: float | None = None) -> None:
        """Have ``streamrl judge`` score this trajectory relative to its group (docs/judge.md) instead of a
        reward of its own; with ``reward()`` too, the two are mixed: ``weight * judge + (1 - weight) * reward``.
        Posted when the block ends. Without ``rubric``, the judge's configured one."""
        judge = {k: v for k, v in (("rubric", rubric), ("weight", weight)) if v is not None}
        try:
            judge_request({"trajectory_id": self.trajectory_id, "judge": judge})  # now, where the bug is
        except RecordError as exc:
            raise ValueError(str(exc)) from None
        self._judge = judge

    @property
    def has_reward(self) -> bool:
        return self._reward is not None or self._judge is not None

    def body(self) -> dict[str, Any]:
        if self._judge is not None:
            if self._metrics:
                raise ValueError("a judged trajectory's metrics come from the judge; reward() without metrics")
            body: dict[str, Any] = {"trajectory_id": self.trajectory_id, "judge": self._judge}
            body.update({k: v for k, v in (("group_id", self.group_id), ("group_size", self.group_size),
                                           ("reward", self._reward)) if v is not None})
            return body
        if self._reward is None:
            raise ValueError(f"trajectory {self.trajectory_id} has no reward")
        return reward_body(self.trajectory_id, self._reward, self.group_id, self.group_size, self._metrics)

    def _should_post(self, exc_type: type[BaseException] | None) -> bool:
        return exc_type is None and self.has_reward and not self.posted

    def _should_end(self, exc_type: type[BaseException] | None) -> bool:
        """Ended cleanly with no reward posted: the gateway hears of the end from ``end_trajectories``."""
        return exc_type is None and not self.has_reward and not self.posted


class Trajectory(_Episode):
    """One episode: every call through ``client`` is tagged with its ids; the reward is posted at exit."""

    def __init__(self, gateway: Gateway | str, *, group_id: str | None = None, group_size: int | None = None,
                 trajectory_id: str | None = None, purpose: str = "train") -> None:
        super().__init__(group_id, group_size, trajectory_id, purpose)
        self._owns_gateway = isinstance(gateway, str)
        self.gateway = Gateway(gateway) if isinstance(gateway, str) else gateway
        self.base_url = self.gateway.base_url
        self.http = self.gateway.http
        self.client: openai.OpenAI = self.gateway.openai.with_options(default_headers=self.headers)

    def post(self) -> None:
        """Post the reward now (``__exit__`` does this when a reward was set)."""
        self.gateway.post_rewards([self.body()])
        self.posted = True

    def __enter__(self) -> Trajectory:
        self.gateway.served.open[self.trajectory_id] = self
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.gateway.served.open.pop(self.trajectory_id, None)
        try:
            if self._should_post(exc_type):
                self.post()
            elif self._should_end(exc_type):
                self.gateway.end_trajectories([self.trajectory_id])
        finally:
            if self._owns_gateway:
                self.gateway.close()


class AsyncGateway:
    """``Gateway`` for asyncio agents (``openai.AsyncOpenAI``, ``httpx.AsyncClient``).

    Its HTTP client is httpx's API on aiohttp's connection pool (``httpx-aiohttp``, the backend of
    ``openai.DefaultAioHttpClient``): httpcore's pool scans every connection for every request, which
    with a few hundred trajectories in flight made it the bottleneck of one asyncio producer
    (``bench/producer_bench.py``; docs/benchmarks.md, "Producer SDK")."""

    def __init__(self, url: str, *, api_key: str = "unused", timeout: float = 600.0, max_retries: int = 0,
                 max_connections: int = 256, http_client: httpx.AsyncClient | None = None) -> None:
        """``http_client``: bring your own (proxies, TLS settings); it is closed with the gateway."""
        self.base_url = _v1(url)
        self.served = _Served()
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self.http = http_client or HttpxAiohttpClient(timeout=timeout, limits=limits)
        self.http.event_hooks["response"].append(self.served.async_hook)
        self._auth = {"Authorization": f"Bearer {api_key}"}
        self.openai = openai.AsyncOpenAI(base_url=self.base_url, api_key=api_key, http_client=self.http,
                                         max_retries=max_retries)

    def trajectory(self, *, group_id: str | None = None, group_size: int | None = None,
                   trajectory_id: str | None = None, purpose: str = "train") -> AsyncTrajectory:
        return AsyncTrajectory(self, group_id=group_id, group_size=group_size, trajectory_id=trajectory_id,
                               purpose=purpose)

    async def post_rewards(self, bodies: list[dict[str, Any]]) -> None:
        _check(await self.http.post(f"{self.base_url}/rewards", json=bodies, headers=self._auth))

    async def end_trajectories(self, trajectory_ids: list[str]) -> None:
        """Say these episodes ended without a reward (``POST /v1/trajectories/end``); never raises."""
        try:
            response: httpx.Response | Exception = await self.http.post(
                f"{self.base_url}/trajectories/end", json={"trajectory_ids": trajectory_ids}, headers=self._auth)
        except httpx.HTTPError as exc:
            response = exc
        _ended(trajectory_ids[0], response)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> AsyncGateway:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class AsyncTrajectory(_Episode):
    """``Trajectory`` for asyncio agents: ``async with gateway.trajectory(...) as t``."""

    def __init__(self, gateway: AsyncGateway, *, group_id: str | None = None, group_size: int | None = None,
                 trajectory_id: str | None = None, purpose: str = "train") -> None:
        super().__init__(group_id, group_size, trajectory_id, purpose)
        self.gateway = gateway
        self.base_url = gateway.base_url
        self.http = gateway.http
        """The gateway's HTTP pool: give it to a framework's own OpenAI client (``http_async_client=``) so that
        its calls share the pool and count towards ``version``."""
        self.client: openai.AsyncOpenAI = gateway.openai.with_options(default_headers=self.headers)

    async def post(self) -> None:
        await self.gateway.post_rewards([self.body()])
        self.posted = True

    async def __aenter__(self) -> AsyncTrajectory:
        self.gateway.served.open[self.trajectory_id] = self
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.gateway.served.open.pop(self.trajectory_id, None)
        if self._should_post(exc_type):
            await self.post()
        elif self._should_end(exc_type):
            await self.gateway.end_trajectories([self.trajectory_id])
