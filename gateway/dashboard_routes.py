"""The dashboard's routes: the page and its assets (files of this package, no CDN), and its data.

``POST /dashboard/eval`` takes a held-out evaluation's result for a version of a policy (``producers/evaluate.py``
posts each one). ``GET /dashboard/data?since=T&seq=N&policy=P`` answers ``Dashboard.snapshot(since, seq, P)`` (the
versions of policy ``P``, the default one without it, changed after ``seq``, the samples after ``T``, and every
policy's line); with ``seq`` equal to the current one it first waits (at most ``wait`` seconds, 15 by default) for
something to change, so that an open page gets each change as it happens with one request in flight and none
while nothing happens (a long poll: no per-viewer state in the gateway). A policy not served here is a 404 (a
400 in an evaluation's body). Every route needs the ``admin`` scope when API keys are checked
(``auth.ROUTE_SCOPES``).
"""

from __future__ import annotations

import math
from importlib.resources import files

import orjson
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from .dashboard import Dashboard
from .proxy import JSON, error_response

STATIC = files(__package__) / "static"
ASSETS = {"dashboard.js": "text/javascript; charset=utf-8", "dashboard.css": "text/css; charset=utf-8"}
"""The files the page loads, by name (nothing else under ``static`` is served)."""
MAX_WAIT_S = 30.0
EVAL_FIELDS: dict[str, type | tuple[type, ...]] = {"version": int, "score": (int, float), "answered": int,
                                                   "problems": int}


def add_dashboard_routes(app: FastAPI, dashboard: Dashboard) -> None:
    page = (STATIC / "dashboard.html").read_bytes()
    assets = {name: (STATIC / name).read_bytes() for name in ASSETS}

    @app.get("/dashboard")
    async def dashboard_page() -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/static/{name}")
    async def dashboard_asset(name: str) -> Response:
        if name not in assets:
            return error_response(404, f"no dashboard asset {name!r}")
        return Response(assets[name], media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})

    def unknown_policy(policy: str) -> str:
        return f"no policy {policy!r} on this gateway: it serves {', '.join(dashboard.boards)}"

    @app.post("/dashboard/eval")
    async def dashboard_eval(request: Request) -> Response:
        """An evaluator's result for one version: ``{"version", "score", "answered", "problems"}``, and the
        ``policy`` it is a version of (the default one without it)."""
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError as exc:
            return error_response(400, f"invalid JSON: {exc}")
        for key, kind in EVAL_FIELDS.items():
            value = body.get(key) if isinstance(body, dict) else None
            if not isinstance(value, kind) or isinstance(value, bool) or (key != "score" and value < 0):
                return error_response(400, f"{key} must be a non-negative {'number' if key == 'score' else 'integer'}",
                                      key)
        if not math.isfinite(body["score"]):
            return error_response(400, "score must be finite", "score")
        policy = body.get("policy")
        if policy is not None and not isinstance(policy, str):
            return error_response(400, "policy must be a policy name", "policy")
        if policy is not None and policy not in dashboard.boards:
            return error_response(400, unknown_policy(policy), "policy")
        dashboard.evaluated(body["version"], float(body["score"]), body["answered"], body["problems"], policy)
        return Response(b'{"accepted":1}', media_type=JSON)

    @app.get("/dashboard/data")
    async def dashboard_data(request: Request) -> Response:
        q = request.query_params
        try:
            since = float(q.get("since", 0))
            seq = int(q["seq"]) if "seq" in q else None
            wait = float(q.get("wait", 15))
        except ValueError:
            return error_response(400, "since and wait must be numbers, seq an integer")
        if not 0 <= wait <= MAX_WAIT_S:
            return error_response(400, f"wait must be between 0 and {MAX_WAIT_S:.0f} seconds", "wait")
        policy = q.get("policy") or None
        if policy is not None and policy not in dashboard.boards:
            return error_response(404, unknown_policy(policy), "policy")
        if seq is not None:
            await dashboard.changed(seq, wait)
        return Response(orjson.dumps(dashboard.snapshot(since, seq, policy)), media_type=JSON,
                        headers={"Cache-Control": "no-store"})
