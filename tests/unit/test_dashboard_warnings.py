"""The dashboard's warnings (``gateway/dashboard.py``), from what reaches the gateway: versions whose policy
record says the trainer was diverging, and held-out evaluations below the base model's (version 0's)."""

from __future__ import annotations

from typing import Any

from streamrl.broker.schema import PolicyRecord
from streamrl.gateway.dashboard import RECENT_VERSIONS, Dashboard
from streamrl.gateway.metrics import GatewayMetrics
from streamrl.gateway.policy import PolicyRouter
from streamrl.gateway.upstreams import UpstreamPool

HEALTHY = {"kl_behaviour": 0.3, "ratio_mean": 0.97, "truncated_frac": 0.05, "staleness_mean": 1.0,
           "diverging": 0.0}
DIVERGING = {"kl_behaviour": 8.8, "ratio_mean": 0.59, "truncated_frac": 0.1, "staleness_mean": 1.0,
             "diverging": 1.0}


def dashboard() -> Dashboard:
    pool = UpstreamPool(("http://127.0.0.1:9",))
    return Dashboard(PolicyRouter("policy", pool), pool, GatewayMetrics(), lambda: None, lambda: 0)


def publish(d: Dashboard, version: int, metrics: dict[str, float]) -> None:
    d.published(PolicyRecord("policy", version, f"/a/v{version}", "base", version, "0" * 64, metrics))


def warnings(d: Dashboard, kind: str) -> list[dict[str, Any]]:
    return [w for w in d.snapshot()["warnings"] if w["kind"] == kind]


def test_a_recent_version_trained_while_diverging_is_a_warning_until_it_is_old() -> None:
    d = dashboard()
    for v in (1, 2):
        publish(d, v, HEALTHY)
    assert d.snapshot()["warnings"] == []
    publish(d, 3, DIVERGING)
    publish(d, 4, DIVERGING)
    [w] = warnings(d, "diverging")
    assert w["versions"] == [3, 4]
    assert "v3, v4 trained while diverging" in w["text"] and "KL 8.8 nats/token, mean ratio 0.59" in w["text"]
    assert "lower learning_rate" in w["text"]
    for v in range(5, 5 + RECENT_VERSIONS):
        publish(d, v, HEALTHY)
    assert warnings(d, "diverging") == [], "healthy again for RECENT_VERSIONS versions"
    publish(d, 99, {"reward_mean": 0.5})  # a record without the field (an older trainer, streamrl publish)
    assert warnings(d, "diverging") == []


def test_an_evaluation_below_the_base_models_is_marked_and_the_latest_one_is_a_warning() -> None:
    d = dashboard()
    d.evaluated(2, 0.1, 64, 64)  # before the base model's score is known: not judged yet
    seq = d.seq
    d.evaluated(0, 0.125, 64, 64)
    evals = {v["version"]: v["eval"] for v in d.snapshot(seq=seq)["versions"]}
    assert evals[2]["below_base"] and not evals[0]["below_base"], "judged, and sent again, once the base is known"
    d.evaluated(3, 0.0, 60, 64)
    [w] = warnings(d, "below_base")
    assert w["versions"] == [3] and "v3 (0.000) is below the base model's (0.125)" in w["text"]
    d.evaluated(4, 0.125, 64, 64)  # equal is not below
    assert warnings(d, "below_base") == []
    views = {v["version"]: v["eval"]["below_base"] for v in d.snapshot()["versions"]}
    assert views == {0: False, 2: True, 3: True, 4: False}
