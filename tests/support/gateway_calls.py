"""Calls the gateway tests make: the openai client on a gateway, vLLM asked directly, and a matcher for
one request's completion record."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import openai

from streamrl.broker.schema import CompletionRecord
from streamrl.engine.server import Engine
from streamrl.gateway.server import GatewayServer


def client(gw: GatewayServer, **kw: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0, **kw)


def of_request(request_id: str) -> Callable[[Any], bool]:
    return lambda r: isinstance(r, CompletionRecord) and r.request_id == request_id


def direct(engine: Engine, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """What vLLM itself returns, asking for token ids and logprobs."""
    r = httpx.post(f"{engine.url}/v1/{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()
