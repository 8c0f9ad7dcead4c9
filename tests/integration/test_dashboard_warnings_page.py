"""The dashboard page shows its warnings: the routes of ``gateway/dashboard_routes.py`` over a dashboard fed
what a diverging run's policy records and evaluations carry, served by uvicorn, read by headless Chromium."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import FastAPI

from streamrl.broker.embedded import free_port
from streamrl.broker.schema import PolicyRecord
from streamrl.gateway.dashboard import Dashboard
from streamrl.gateway.dashboard_routes import add_dashboard_routes
from streamrl.gateway.metrics import GatewayMetrics
from streamrl.gateway.policy import PolicyRouter
from streamrl.gateway.upstreams import UpstreamPool

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
SCORES = [0.125, 0.14, 0.17, 0.11, 0.06, 0.0]
"""Held-out scores of versions 0-5: above the base model's, then below it once the trainer diverged (v3)."""


def diverging_run() -> Dashboard:
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


@pytest.fixture
def page_url() -> Iterator[str]:
    app = FastAPI()
    add_dashboard_routes(app, diverging_run())
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
    yield f"http://127.0.0.1:{port}/dashboard"
    server.should_exit = True
    thread.join(30)


def test_the_page_warns_of_divergence_and_marks_evaluations_below_base(page_url: str) -> None:
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        pytest.skip(f"needs Debian's chromium and chromium-driver ({CHROMIUM}, {CHROMEDRIVER})")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless", "--no-sandbox", "--disable-background-networking", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        driver.get(page_url)
        WebDriverWait(driver, 30).until(lambda d: d.find_elements("css selector", "#warnings .warning"))
        shown = {w.get_attribute("data-kind"): w for w in driver.find_elements("css selector", "#warnings .warning")}
        assert set(shown) == {"diverging", "below_base"} and all(w.is_displayed() for w in shown.values())
        assert "v3, v4, v5 trained while diverging" in shown["diverging"].text
        assert "KL 9.1 nats/token" in shown["diverging"].text
        assert "v5 (0.000) is below the base model's (0.125)" in shown["below_base"].text
        series = driver.find_element("id", "eval").get_attribute("data-series")
        assert series == "held-out score:6,base model (v0):2,below base:3"  # v3, v4, v5
    finally:
        driver.quit()
