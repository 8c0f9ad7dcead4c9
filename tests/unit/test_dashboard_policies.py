"""The dashboard of a gateway serving several policies (``gateway/dashboard.py``, ``dashboard_routes.py``): every
policy listed with its routed version, swaps, calls and rewards; ``/dashboard/data?policy=`` gives one policy's
versions, samples and warnings (an unknown one is a 404 naming those served); rewards count for the version of
the policy that served their call; evaluations name their policy."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from streamrl.broker.schema import PolicyRecord, RewardRecord
from streamrl.gateway.dashboard import Dashboard
from streamrl.gateway.dashboard_routes import add_dashboard_routes
from streamrl.gateway.metrics import GatewayMetrics
from streamrl.gateway.policy import PolicyTable, VersionState
from streamrl.gateway.upstreams import UpstreamPool

DIVERGING = {"kl_behaviour": 8.8, "ratio_mean": 0.59, "truncated_frac": 0.1, "staleness_mean": 1.0, "diverging": 1.0}


def record(name: str, version: int, metrics: dict[str, float] | None = None) -> PolicyRecord:
    return PolicyRecord(name, version, f"/a/{name}/v{version}", "base", version, "0" * 64, metrics or {})


@pytest.fixture
def two() -> tuple[Dashboard, PolicyTable, GatewayMetrics, TestClient]:
    """A dashboard of policies ``support`` (the default) and ``sql``, with sql routed to v2 and swapped twice, and
    its routes."""
    pool = UpstreamPool(("http://127.0.0.1:9",), policies=2)
    table, metrics = PolicyTable(("support", "sql"), pool), GatewayMetrics()
    d = Dashboard(table, pool, metrics, lambda: None, lambda: 0)
    sql = d.board("sql")
    for v in (1, 2):
        sql.published(record("sql", v, {"reward_mean": 0.1 * v}))  # as sql's follower tells its board
        table.routers["sql"].route(VersionState(record("sql", v), loaded_at=1.0))
        sql.routed(v, 100.0 + v)
        metrics.swaps.labels("sql").inc()
    app = FastAPI()
    add_dashboard_routes(app, d)
    return d, table, metrics, TestClient(app)


def data(client: TestClient, **params: Any) -> dict[str, Any]:
    r = client.get("/dashboard/data", params=params)
    assert r.status_code == 200, r.text
    return r.json()


def test_every_policy_is_listed_and_each_has_its_own_view(two) -> None:
    d, _, metrics, client = two
    for status, n in (("200", 3), ("502", 1)):
        for _ in range(n):
            metrics.policy_requests.labels("sql", status).inc()
    metrics.policy_requests.labels("support", "200").inc()
    metrics.rewards.labels("sql").inc()
    d.sample()
    default = data(client)
    assert default["policy"] == {"name": "support", "version": 0, "served_name": None}
    assert default["versions"] == [], "sql's versions are not support's"
    lines = {p["name"]: p for p in default["policies"]}
    assert list(lines) == ["support", "sql"] and lines["support"]["default"] and not lines["sql"]["default"]
    assert lines["sql"] | {"warnings": None} == {
        "name": "sql", "default": False, "version": 2, "served_name": "sql@v2", "calls": 0, "rewards": 0,
        "requests": 4.0, "requests_failed": 1.0, "rewards_named": 1.0, "swaps": 2.0, "warnings": None}
    assert lines["support"]["requests"] == 1.0 and lines["support"]["swaps"] == 0.0

    sql = data(client, policy="sql")
    assert sql["policy"] == {"name": "sql", "version": 2, "served_name": "sql@v2"}
    assert [(v["version"], v["trainer"], v["routed"]) for v in sql["versions"]] == [
        (1, {"reward_mean": 0.1}, 101.0), (2, {"reward_mean": 0.2}, 102.0)]
    [point] = sql["points"]
    assert "policies" not in point, "a viewer gets its policy's counters, not every policy's"
    assert (point["version"], point["policy_requests"], point["policy_requests_failed"], point["policy_rewards"],
            point["policy_swaps"]) == (2, 4.0, 1.0, 1.0, 2.0)
    assert point["requests"] == 0.0, "the gateway's own counters (by route) stay as they were"
    assert data(client)["points"][0]["version"] == 0 and data(client)["points"][0]["policy_requests"] == 1.0
    assert sql["policies"] == default["policies"]


def test_an_unknown_policy_is_a_404_naming_those_served(two) -> None:
    _, _, _, client = two
    r = client.get("/dashboard/data", params={"policy": "nope", "seq": 0, "wait": 30})  # answered before any wait
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["param"] == "policy" and error["message"] == "no policy 'nope' on this gateway: it serves support, sql"
    assert client.get("/dashboard/data", params={"policy": ""}).json()["policy"]["name"] == "support"


def test_rewards_count_for_the_policy_and_version_that_served_the_call(two) -> None:
    d, _, _, client = two
    d.served("s1", 0)  # the completion path without a policy: the default one
    d.served("q1", 2, "sql")
    d.served("q2", 2, "sql")
    d.served("q3", 1, "sql")
    d.rewarded([RewardRecord("s1", 1.0), RewardRecord("q1", 0.5), RewardRecord("q2", 1.5, policy="sql"),
                RewardRecord("q3", 1.0, policy="support"),  # names another policy: its trainer skips it
                RewardRecord("never-served", 1.0)])
    sql = {v["version"]: v for v in data(client, policy="sql")["versions"]}
    assert (sql[2]["calls"], sql[2]["rewards"], sql[2]["reward_mean"]) == (2, 2, 1.0)
    assert (sql[1]["calls"], sql[1]["rewards"]) == (1, 0)
    [v0] = data(client)["versions"]
    assert (v0["version"], v0["calls"], v0["rewards"], v0["reward_mean"]) == (0, 1, 1, 1.0)
    default = data(client)
    assert default["rewards_unattributed"] == 2
    assert {p["name"]: (p["calls"], p["rewards"]) for p in default["policies"]} == {"support": (1, 1), "sql": (3, 2)}
    d.rewarded([RewardRecord("q3", 0.0, policy="sql")])  # its own policy's reward still finds it
    assert {v["version"]: v["rewards"] for v in data(client, policy="sql")["versions"]}[1] == 1


def test_evaluations_and_warnings_are_per_policy(two) -> None:
    d, _, _, client = two
    for body in ({"version": 0, "score": 0.5, "answered": 4, "problems": 4, "policy": "sql"},
                 {"version": 2, "score": 0.25, "answered": 4, "problems": 4, "policy": "sql"},
                 {"version": 0, "score": 0.1, "answered": 4, "problems": 4}):  # no policy: the default one
        assert client.post("/dashboard/eval", json=body).status_code == 200
    for bad in ({"policy": "nope"}, {"policy": 3}):
        r = client.post("/dashboard/eval", json={"version": 1, "score": 0.5, "answered": 1, "problems": 1, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "policy", bad
    d.published(record("sql", 3, DIVERGING))  # a record routed by its name to its policy's board
    d.published(record("other", 9, DIVERGING))  # a policy not served here: ignored
    sql = data(client, policy="sql")
    evals = {v["version"]: v["eval"] for v in sql["versions"] if v["eval"]}
    assert evals[0]["score"] == 0.5 and evals[2]["below_base"]
    assert {w["kind"]: w["policy"] for w in sql["warnings"]} == {"diverging": "sql", "below_base": "sql"}
    assert "Trainer of sql diverging: v3 trained while diverging" in sql["warnings"][0]["text"]
    assert "Held-out score of sql v2 (0.250) is below" in sql["warnings"][1]["text"]
    default = data(client)
    assert default["warnings"] == [] and [v["eval"]["score"] for v in default["versions"]] == [0.1]
    assert {p["name"]: p["warnings"] for p in default["policies"]} == {"support": [],
                                                                       "sql": ["diverging", "below_base"]}
    assert 9 not in {v["version"] for v in sql["versions"]}


def test_one_policy_reads_as_before() -> None:
    pool = UpstreamPool(("http://127.0.0.1:9",))
    d = Dashboard(PolicyTable(("policy",), pool), pool, GatewayMetrics(), lambda: None, lambda: 0)
    d.published(record("policy", 1, DIVERGING))
    snapshot = d.snapshot()
    assert [p["name"] for p in snapshot["policies"]] == ["policy"] and snapshot["policy"]["name"] == "policy"
    assert snapshot["warnings"][0]["text"].startswith("Trainer diverging: v1 trained"), "no policy name with one"
    assert d.versions is d.board().versions and d.board("policy") is d.default
    with pytest.raises(KeyError):
        d.snapshot(policy="other")
