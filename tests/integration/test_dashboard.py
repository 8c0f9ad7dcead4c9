"""The live dashboard (``/dashboard``): what the gateway keeps for it, who may read it, and the page itself
in a real browser (Debian's Chromium, headless, driven by Selenium) during a short real loop: vLLM on the
tiny model, the gateway, the trainer publishing versions, a producer posting rewards. The reward chart
must gain points as versions are published and served."""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from streamrl.broker.embedded import EmbeddedBroker, free_port
from streamrl.broker.topics import Topics, create_topics
from streamrl.engine.server import Engine
from streamrl.gateway.config import GatewayConfig, GatewayKafka
from streamrl.gateway.server import GatewayServer
from streamrl.producers.client import Gateway
from streamrl.trainer.config import TrainerConfig
from streamrl.trainer.daemon import run_trainer

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
ADMIN, INFERENCE = "sk-dash-admin-0123456789abcdef", "sk-dash-infer-0123456789abcdef"
GROUP_SIZE = 4


def unload(engine: Engine, name: str) -> None:
    for card in httpx.get(f"{engine.url}/v1/models").json()["data"]:
        if card.get("parent") and card["id"].startswith(f"{name}@"):
            httpx.post(f"{engine.url}/v1/unload_lora_adapter", json={"lora_name": card["id"]})


def play_group(gw: Gateway, name: str, group: str) -> list[int]:
    """One group of real calls through the gateway, each rewarded (rewards differ: the group has signal);
    the versions that served them."""
    versions = []
    for i in range(GROUP_SIZE):
        with gw.trajectory(group_id=group, group_size=GROUP_SIZE) as t:
            reply = t.client.chat.completions.with_raw_response.create(
                model=name, messages=[{"role": "user", "content": f"count to {i}"}], max_tokens=6)
            versions.append(int(reply.headers["X-Policy-Version"]))
            t.reward(float(i % 2) + 0.1 * i)
    return versions


# -- the gateway's side ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def keyed(broker: EmbeddedBroker, engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayServer]:
    topics = Topics(f"dash{uuid.uuid4().hex[:6]}")
    create_topics(broker.bootstrap_servers, topics, partitions=1)
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"{ADMIN} admin ops\n{INFERENCE} inference,rewards agent\n")
    config = GatewayConfig(upstreams=(engine.url,),
                           kafka=GatewayKafka(bootstrap_servers=broker.bootstrap_servers, topic_prefix=topics.prefix),
                           port=free_port(), policy_name="dashk", health_interval_s=0.5,
                           api_keys=str(keys), dashboard_interval_s=0.2)
    with GatewayServer(config) as server:
        yield server


def test_rewards_count_for_the_version_that_served_the_call(keyed: GatewayServer) -> None:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    before = httpx.get(f"{keyed.url}/dashboard/data", headers=admin).json()
    with Gateway(keyed.url, api_key=INFERENCE) as gw:
        assert play_group(gw, "dashk", "g0") == [0] * GROUP_SIZE
        gw.post_rewards([{"trajectory_id": "never-served", "reward": 1.0}])
    data = httpx.get(f"{keyed.url}/dashboard/data", headers=admin).json()
    [v0] = data["versions"]
    rewards = [float(i % 2) + 0.1 * i for i in range(GROUP_SIZE)]
    mean = sum(rewards) / GROUP_SIZE
    assert v0["version"] == 0 and v0["calls"] == GROUP_SIZE and v0["rewards"] == GROUP_SIZE
    assert v0["reward_mean"] == pytest.approx(mean)
    assert v0["reward_std"] == pytest.approx((sum((r - mean) ** 2 for r in rewards) / GROUP_SIZE) ** 0.5)
    assert data["rewards_unattributed"] == before["rewards_unattributed"] + 1
    assert data["upstreams"][0]["healthy"] and data["policy"] == {"name": "dashk", "version": 0, "served_name": None}
    # the sampler's points: the tokens of the calls above are counted by a later sample
    seq = data["seq"]
    later = httpx.get(f"{keyed.url}/dashboard/data", headers=admin,
                      params={"since": data["points"][-1]["time"], "seq": seq}).json()
    assert later["seq"] > seq and later["points"]
    assert later["versions"] == [], "with seq, only the versions changed since come (none did)"
    last = later["points"][-1]  # completion records go through the producer, rewards straight to Kafka
    assert last["completion_tokens"] > 0 and last["records_offered"] >= GROUP_SIZE and last["rewards"] >= GROUP_SIZE
    assert all(p["time"] > data["points"][-1]["time"] for p in later["points"])


def test_the_page_is_open_its_data_needs_admin(keyed: GatewayServer) -> None:
    page = httpx.get(f"{keyed.url}/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for asset in re.findall(r'(?:src|href)="([^"]+)"', page.text):
        assert asset.startswith("/dashboard/static/"), f"{asset}: every asset comes from the gateway"
        r = httpx.get(f"{keyed.url}{asset}")
        assert r.status_code == 200 and "http://" not in r.text and "https://" not in r.text
    assert httpx.get(f"{keyed.url}/dashboard/static/app.py").status_code == 401  # not an asset: admin...
    assert httpx.get(f"{keyed.url}/dashboard/static/app.py",
                     headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 404  # ...and not served
    assert httpx.get(f"{keyed.url}/dashboard/data").status_code == 401
    r = httpx.get(f"{keyed.url}/dashboard/data", headers={"Authorization": f"Bearer {INFERENCE}"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_scope"
    r = httpx.get(f"{keyed.url}/dashboard/data", params={"wait": "600"}, headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "wait"


def test_an_evaluation_is_shown_with_its_version(keyed: GatewayServer) -> None:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    url = f"{keyed.url}/dashboard/eval"
    r = httpx.post(url, json={"version": 7, "score": 0.75, "answered": 4, "problems": 4}, headers=admin)
    assert r.status_code == 200
    v7 = [v for v in httpx.get(f"{keyed.url}/dashboard/data", headers=admin).json()["versions"] if v["version"] == 7]
    assert v7[0]["eval"]["score"] == 0.75 and v7[0]["eval"]["problems"] == 4 and v7[0]["rewards"] == 0
    for body, param in [({"version": 7, "score": "high", "answered": 1, "problems": 1}, "score"),
                        ({"version": -1, "score": 0.5, "answered": 1, "problems": 1}, "version"),
                        ({"version": 7, "score": 0.5, "problems": 1}, "answered")]:
        r = httpx.post(url, json=body, headers=admin)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, body
    assert httpx.post(url, content=b"{", headers=admin).status_code == 400
    r = httpx.post(url, json={"version": 7, "score": 1.0, "answered": 1, "problems": 1},
                   headers={"Authorization": f"Bearer {INFERENCE}"})
    assert r.status_code == 403  # what the dashboard shows is the operator's


# -- the page in a real browser during a real loop ---------------------------------------------------

def browser():
    """Headless Chromium through the system chromedriver (Selenium Manager is never asked to download)."""
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        pytest.skip(f"needs Debian's chromium and chromium-driver ({CHROMIUM}, {CHROMEDRIVER}): "
                    "scripts/setup.sh installs them with apt")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless", "--no-sandbox", "--disable-background-networking", "--disable-dev-shm-usage",
                "--window-size=1400,1700"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def served_points(driver) -> int:
    """Points of the reward chart's ``served`` series, as the page drew them."""
    series = driver.find_element("id", "reward-version").get_attribute("data-series") or ""
    found = re.search(r"(?:^|,)served:(\d+)", series)
    return int(found.group(1)) if found else 0


@pytest.fixture(scope="module")
def loop(tiny_model: Path, broker: EmbeddedBroker, engine: Engine,
         tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The dashboard open in Chromium while a real loop runs, until its reward chart shows 4 versions; what
    the page showed along the way, the dashboard's data and both parts' /metrics at the end."""
    from selenium.webdriver.support.ui import WebDriverWait

    driver = browser()
    tmp_path = tmp_path_factory.mktemp("dashloop")
    topics = Topics(f"dashl{uuid.uuid4().hex[:6]}")
    create_topics(broker.bootstrap_servers, topics, partitions=1)
    name = "dashloop"
    trainer = TrainerConfig.load(None, model=str(tiny_model), bootstrap_servers=broker.bootstrap_servers, name=name,
                            adapters=str(tmp_path / "adapters"), topic_prefix=topics.prefix, groups_per_step=1,
                            max_step_tokens=0, device="cpu", history=str(tmp_path / "history.jsonl"),
                            metrics_port=free_port())
    config = GatewayConfig(upstreams=(engine.url,),
                           kafka=GatewayKafka(bootstrap_servers=broker.bootstrap_servers, topic_prefix=topics.prefix),
                           port=free_port(), policy_name=name, health_interval_s=0.5,
                           adapter_root=trainer.adapters, dashboard_interval_s=0.5, policy_catch_up_s=1.0)
    stop = threading.Event()
    trainer_thread = threading.Thread(target=run_trainer, args=(trainer, stop), name="trainer", daemon=True)
    produced: list[int] = []

    def produce(url: str) -> None:
        with Gateway(url) as gw:
            g = 0
            while not stop.is_set():
                produced.extend(play_group(gw, name, f"g{g}"))
                g += 1

    out: dict[str, Any] = {"produced": produced}
    try:
        with GatewayServer(config) as gw:
            producer = threading.Thread(target=produce, args=(gw.url,), name="producer", daemon=True)
            driver.get(f"{gw.url}/dashboard")
            WebDriverWait(driver, 30).until(
                lambda d: d.find_element("id", "status").get_attribute("data-state") == "live")
            out["initial"] = served_points(driver)
            trainer_thread.start()
            producer.start()
            seen = out["seen"] = [out["initial"]]  # the served series' point counts, as they change
            routed = out["routed"] = [0]  # the gateway's routed version at each change

            def grew(d) -> bool:
                n = served_points(d)
                if n != seen[-1]:
                    seen.append(n)
                    routed.append(gw.gateway.router.version)
                return n >= 4

            WebDriverWait(driver, 420, poll_frequency=0.2).until(grew, f"the reward chart stopped at {seen}")
            driver.save_screenshot(os.environ.get("STREAMRL_DASHBOARD_SCREENSHOT") or str(tmp_path / "dashboard.png"))
            out["data"] = httpx.get(f"{gw.url}/dashboard/data").json()
            out["gateway_metrics"] = httpx.get(f"{gw.url}/metrics").text
            out["trainer_metrics"] = httpx.get(f"http://127.0.0.1:{trainer.metrics_port}/metrics").text
            stop.set()
            producer.join(120)
    finally:
        stop.set()
        driver.quit()
        if trainer_thread.is_alive():
            trainer_thread.join(120)
        unload(engine, name)
    return out


def test_the_reward_chart_gains_points_as_versions_are_published(loop: dict[str, Any]) -> None:
    seen, routed, data = loop["seen"], loop["routed"], loop["data"]
    assert loop["initial"] == 0, "nothing served yet when the page opened"
    assert seen == sorted(seen) and seen[-1] >= 4, seen  # points only ever added, one per served version
    assert routed == sorted(routed) and routed[-1] >= 3, "points came as versions were published and routed"
    rewarded = [v for v in data["versions"] if v["rewards"]]
    assert len(rewarded) >= 4 and rewarded[0]["version"] == 0  # the base model's, then each version served
    published = [v for v in data["versions"] if v["version"] >= 1 and v["published"]]
    assert len(published) >= 3 and all("reward_mean" in v["trainer"] and "staleness_mean" in v["trainer"]
                                       and "kafka_lag" in v["trainer"] for v in published)
    assert all(v["publish_to_route_s"] >= 0 for v in published if v["routed"])
    # the calls were served by the base model, then by versions as they came (the gateway routes the newest
    # it has: a version superseded before it was routed serves nothing, so not every number appears)
    served = set(loop["produced"])
    assert min(served) == 0 and len(served) >= 4, served


GRAFANA = Path(__file__).parents[2] / "infra" / "grafana" / "dashboards" / "streamrl.json"


def queried_metrics(board: dict[str, Any]) -> set[str]:
    """The metric names of every panel's PromQL (streamrl's all start with ``streamrl_``)."""
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    return {m for e in exprs for m in re.findall(r"\bstreamrl_[a-z0-9_]+", e)}


def exported_metrics(text: str) -> set[str]:
    """Sample names of a Prometheus text exposition."""
    return {re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line).group(0) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_the_grafana_dashboard_queries_only_exported_metrics(loop: dict[str, Any]) -> None:
    board = json.loads(GRAFANA.read_text())
    queried = queried_metrics(board)
    assert len(queried) >= 20 and "streamrl_trainer_kafka_lag" in queried
    exported = exported_metrics(loop["gateway_metrics"]) | exported_metrics(loop["trainer_metrics"])
    assert queried - exported == set(), "the Grafana dashboard queries metrics nobody exports"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)) and all(p["datasource"]["uid"] == "streamrl-prometheus" for p in board["panels"])
