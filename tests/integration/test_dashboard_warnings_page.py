"""The dashboard page shows its warnings, and with several policies a tab and a table line per policy: the routes
of ``gateway/dashboard_routes.py`` over a dashboard fed what a diverging run's policy records and evaluations
carry (and a second policy's), served by uvicorn, read by headless Chromium."""

from __future__ import annotations

import contextlib
import shutil
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI

from streamrl.broker.embedded import free_port
from streamrl.broker.schema import PolicyRecord, RewardRecord
from streamrl.gateway.dashboard import Dashboard
from streamrl.gateway.dashboard_routes import add_dashboard_routes
from streamrl.gateway.metrics import GatewayMetrics
from streamrl.gateway.policy import PolicyRouter, PolicyTable, VersionState
from streamrl.gateway.upstreams import UpstreamPool

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
SCORES = [0.125, 0.14, 0.17, 0.11, 0.06, 0.0]
"""Held-out scores of versions 0-5: above the base model's, then below it once the trainer diverged (v3)."""


def diverging_run(d: Dashboard | None = None) -> Dashboard:
    """Policy ``policy``'s run (on ``d``, or a dashboard of that one policy)."""
    if d is None:
        pool = UpstreamPool(("http://127.0.0.1:9",))
        d = Dashboard(PolicyRouter("policy", pool), pool, GatewayMetrics(), lambda: None, lambda: 0)
    d.evaluated(0, SCORES[0], 64, 64)
    for v in range(1, len(SCORES)):
        diverging = v >= 3
        d.published(PolicyRecord("policy", v, f"/adapters/v{v}", "base", v, "0" * 64, {
            "kl_behaviour": 9.1 if diverging else 0.02, "ratio_mean": 0.52 if diverging else 1.0,
            "truncated_frac": 0.1, "staleness_mean": 1.0, "diverging": float(diverging)}))
        d.evaluated(v, SCORES[v], 64, 64)
    return d


def two_policies() -> Dashboard:
    """``policy``'s diverging run beside ``sql``'s healthy one: sql routed to v2, its calls rewarded, two
    versions evaluated, and a sample of the gateway's counters (sql served 3 calls, one failed)."""
    pool = UpstreamPool(("http://127.0.0.1:9",), policies=2)
    table, metrics = PolicyTable(("policy", "sql"), pool), GatewayMetrics()
    d = diverging_run(Dashboard(table, pool, metrics, lambda: None, lambda: 0))
    sql = d.board("sql")
    for v in (1, 2):
        sql.published(PolicyRecord("sql", v, f"/adapters/sql/v{v}", "base", v, "0" * 64, {"reward_mean": 0.3 * v}))
        table.routers["sql"].route(VersionState(PolicyRecord("sql", v, "/a", "base", v, "0" * 64), loaded_at=1.0))
        sql.routed(v, time.time())
        metrics.swaps.labels("sql").inc()
        sql.evaluated(v, 0.2 * v, 64, 64)
    for i, version in enumerate((0, 1, 2)):
        d.served(f"q{i}", version, "sql")
    d.rewarded([RewardRecord(f"q{i}", 0.5 * i) for i in range(3)])
    for status in ("200", "200", "502"):
        metrics.policy_requests.labels("sql", status).inc()
    d.sample()
    return d


@contextlib.contextmanager
def served(dashboard: Dashboard) -> Iterator[str]:
    """The dashboard's routes served by uvicorn on a free port; the page's address."""
    app = FastAPI()
    add_dashboard_routes(app, dashboard)
    port = free_port()
    # a long poll of the closed page may still be waiting: shutdown does not wait for it
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, name="dashboard-page", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the page's server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}/dashboard"
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture
def page_url() -> Iterator[str]:
    with served(diverging_run()) as url:
        yield url


@pytest.fixture
def driver():
    """Headless Chromium through the system chromedriver."""
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        pytest.skip(f"needs Debian's chromium and chromium-driver ({CHROMIUM}, {CHROMEDRIVER})")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless", "--no-sandbox", "--disable-background-networking", "--disable-dev-shm-usage",
                "--window-size=1400,1700"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def test_the_page_warns_of_divergence_and_marks_evaluations_below_base(page_url: str, driver) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(page_url)
    WebDriverWait(driver, 30).until(lambda d: d.find_elements("css selector", "#warnings .warning"))
    shown = {w.get_attribute("data-kind"): w for w in driver.find_elements("css selector", "#warnings .warning")}
    assert set(shown) == {"diverging", "below_base"} and all(w.is_displayed() for w in shown.values())
    assert "v3, v4, v5 trained while diverging" in shown["diverging"].text
    assert "KL 9.1 nats/token" in shown["diverging"].text
    assert "v5 (0.000) is below the base model's (0.125)" in shown["below_base"].text
    series = driver.find_element("id", "eval").get_attribute("data-series")
    assert series == "held-out score:6,base model (v0):2,below base:3"  # v3, v4, v5
    for one_policy_only in ("policy-tabs", "policies-section", "requests-section"):  # looks as it always did
        assert not driver.find_element("id", one_policy_only).is_displayed(), one_policy_only


def test_with_two_policies_a_tab_each_picks_whose_charts_are_drawn(driver) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    def tabs() -> dict[str, Any]:
        return {b.get_attribute("data-policy"): b for b in driver.find_elements("css selector", "#policy-tabs button")}

    def header() -> str:
        return driver.find_element("id", "policy").text

    with served(two_policies()) as url:
        driver.get(url)
        WebDriverWait(driver, 30).until(lambda d: len(tabs()) == 2)
        shown = tabs()
        assert shown["policy"].get_attribute("aria-pressed") == "true" and shown["policy"].is_displayed()
        assert "warned" in shown["policy"].get_attribute("class"), "its trainer diverged: the tab says so"
        assert "warned" not in shown["sql"].get_attribute("class") and shown["sql"].text == "sql v2"
        rows = {r.get_attribute("data-policy"): [c.text for c in r.find_elements("css selector", "td")]
                for r in driver.find_elements("css selector", "#policies tbody tr")}
        assert rows["sql"] == ["sql", "v2", "2", "3", "1", "3", "3", ""]  # routed, swaps, requests, 5xx, calls, rewards
        assert rows["policy"][0] == "policy (default)" and rows["policy"][7] == "diverging, below_base"
        assert header().startswith("policy policy: v0") and driver.find_elements("css selector", "#warnings .warning")

        shown["sql"].click()
        WebDriverWait(driver, 30).until(lambda d: header().startswith("policy sql: v2"))
        WebDriverWait(driver, 30).until(
            lambda d: d.find_element("id", "eval").get_attribute("data-series") == "held-out score:2")
        assert driver.current_url.endswith("/dashboard?policy=sql") and tabs()["sql"].get_attribute("aria-pressed") == "true"
        assert driver.find_elements("css selector", "#warnings .warning") == [], "policy's warnings stay on its tab"
        assert "served:3" in driver.find_element("id", "reward-version").get_attribute("data-series")  # v0, v1, v2
        assert driver.find_element("id", "requests-section").is_displayed()

        driver.get(url + "?policy=nope")  # an old link: the default policy, and the address says so
        WebDriverWait(driver, 30).until(lambda d: header().startswith("policy policy: v0"))
        assert driver.current_url.endswith("/dashboard")
