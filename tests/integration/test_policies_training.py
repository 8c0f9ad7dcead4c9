"""Two policies trained side by side on one gateway and one vLLM server (issue #43): each trainer trains only
on its own policy's trajectories (checked in the batches it trained on), both hot-swap independently while
their agents keep calling, each agent's key reaches its own policy alone, and a restart of one trainer leaves
the other learning and serving."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pyarrow.parquet as pq
import pytest
from support.kafka_reader import TopicReader

from streamrl.broker.embedded import EmbeddedBroker, free_port
from streamrl.broker.policy_log import PolicyLog
from streamrl.broker.schema import PolicyRecord
from streamrl.broker.topics import Topics
from streamrl.engine.server import Engine
from streamrl.gateway.config import GatewayConfig, GatewayKafka
from streamrl.gateway.server import GatewayServer
from streamrl.producers.client import Gateway
from streamrl.trainer.config import TrainerConfig
from streamrl.trainer.daemon import run_trainer

TOPICS = Topics("polytrain")
NAMES = ("adder", "speller")
PROMPTS = {"adder": "add {i} and 2", "speller": "spell the word number {i}"}
KEYS = {name: f"sk-{name}-" + "k" * 20 for name in NAMES}
ADMIN = "sk-admin-" + "a" * 20
GROUP_SIZE = 2


class Agent:
    """One policy's agent: groups of calls through the gateway with its own key, each rewarded (rewards differ
    within a group, so every group has signal), until stopped; every failure kept."""

    def __init__(self, url: str, name: str) -> None:
        self.url, self.name = url, name
        self.served: list[int] = []
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"agent-{name}", daemon=True)

    def _run(self) -> None:
        with Gateway(self.url, api_key=KEYS[self.name]) as gw:
            g = 0
            while not self.stop.is_set():
                try:
                    for i in range(GROUP_SIZE):
                        with gw.trajectory(group_id=f"{self.name}-g{g}", group_size=GROUP_SIZE,
                                           trajectory_id=f"{self.name}-g{g}-{i}") as t:
                            reply = t.client.chat.completions.with_raw_response.create(
                                model=self.name, max_tokens=6,
                                messages=[{"role": "user", "content": PROMPTS[self.name].format(i=i)}])
                            self.served.append(int(reply.headers["X-Policy-Version"]))
                            t.reward(float(i % 2))
                except Exception as exc:  # every failure is the test's to report
                    self.failures.append(f"{type(exc).__name__}: {exc}")
                g += 1


class TrainerThread:
    def __init__(self, config: TrainerConfig) -> None:
        self.config = config
        self.stop = threading.Event()
        self.result: list[int | str] = []
        self.thread = threading.Thread(target=self._run, name=f"trainer-{config.name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.result.append(run_trainer(self.config, self.stop))
        except BaseException as exc:  # the test says what stopped it
            self.result.append(f"{type(exc).__name__}: {exc}")
            raise

    def halt(self) -> None:
        self.stop.set()
        self.thread.join(180)
        assert not self.thread.is_alive() and self.result == [0], f"{self.config.name}'s trainer did not stop cleanly"


def wait_until(what: str, done: Callable[[], bool], explain: Callable[[], object], timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {explain()}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def run(tiny_model: Path, broker: EmbeddedBroker, engine: Engine, topics: Topics,
        tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("policies-training")
    keys = tmp / "keys.txt"
    keys.write_text("".join(f"{KEYS[n]} inference,rewards {n}-team policies={n}\n" for n in NAMES)
                    + f"{ADMIN} admin ops\n")
    trainers = {n: TrainerConfig.load(None, model=str(tiny_model), bootstrap_servers=broker.bootstrap_servers, name=n,
                                 adapters=str(tmp / "adapters" / n), topic_prefix=topics.prefix, group_size=GROUP_SIZE,
                                 groups_per_step=1, max_step_tokens=0, device="cpu", save_batches=str(tmp / "batches" / n),
                                 history=str(tmp / f"history.{n}.jsonl")) for n in NAMES}
    config = GatewayConfig(upstreams=(engine.url,),
                           kafka=GatewayKafka(bootstrap_servers=broker.bootstrap_servers, topic_prefix=topics.prefix),
                           port=free_port(), policy_name=NAMES[0], policies=NAMES, api_keys=str(keys),
                           adapter_root=str(tmp / "adapters"), health_interval_s=0.5, policy_catch_up_s=1.0)
    out: dict[str, Any] = {"trainers": trainers}
    policy_log = TopicReader(broker.bootstrap_servers, topics.policy)  # before the first publication
    running = {n: TrainerThread(c) for n, c in trainers.items()}
    agents: dict[str, Agent] = {}
    try:
        with GatewayServer(config) as gw:
            routers = gw.gateway.policies.routers
            agents = {n: Agent(gw.url, n) for n in NAMES}

            def explain() -> object:
                return {n: (routers[n].version, len(a.served), a.failures[:2], running[n].result,
                            running[n].thread.is_alive()) for n, a in agents.items()}

            for agent in agents.values():
                agent.thread.start()
            wait_until("both policies to route version 2", lambda: all(routers[n].version >= 2 for n in NAMES),
                       explain)
            other = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=KEYS["adder"], max_retries=0)
            with pytest.raises(openai.PermissionDeniedError):
                other.chat.completions.create(model="speller", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=2)
            running["adder"].halt()  # adder's trainer goes away (its last version routed first) ...
            log = PolicyLog(broker.bootstrap_servers, topics)
            newest = log.newest("adder")
            log.close()
            assert newest is not None
            wait_until("adder's last version routed", lambda: routers["adder"].version == newest.version, explain)
            out["adder_before"] = adder_before = newest.version
            speller_before = routers["speller"].version
            wait_until("speller's next version while adder's trainer is down",
                       lambda: routers["speller"].version >= speller_before + 1, explain)
            out["adder_while_down"] = routers["adder"].version
            running["adder"] = TrainerThread(trainers["adder"])  # ... and comes back from its checkpoint
            wait_until("adder's next version after its restart", lambda: routers["adder"].version > adder_before,
                       explain)
            for agent in agents.values():
                agent.stop.set()
            for agent in agents.values():
                agent.thread.join(120)
            out["metrics"] = httpx.get(f"{gw.url}/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
            out["routed"] = routed = {n: routers[n].version for n in NAMES}
            for name, version in routed.items():
                policy_log.wait_for(lambda r, n=name, v=version: isinstance(r, PolicyRecord) and (r.name, r.version) == (n, v))
            out["published"] = {n: [r.version for r in policy_log.seen if isinstance(r, PolicyRecord) and r.name == n]
                                for n in NAMES}
    finally:
        policy_log.close()
        for agent in agents.values():
            agent.stop.set()
        for trainer in running.values():
            if trainer.thread.is_alive():
                trainer.halt()
        for card in httpx.get(f"{engine.url}/v1/models").json()["data"]:
            if card.get("parent") and card["id"].split("@")[0] in NAMES:
                httpx.post(f"{engine.url}/v1/unload_lora_adapter", json={"lora_name": card["id"]})
    out["agents"] = agents
    return out


def test_each_trainer_trains_only_on_its_own_policys_trajectories(run: dict[str, Any]) -> None:
    for name, config in run["trainers"].items():
        files = sorted(Path(config.save_batches).glob("*.parquet"))
        assert files, f"{name}'s trainer saved no batch"
        trained = {t for f in files for t in pq.read_table(f, columns=["trajectory_id"]).column(0).to_pylist()}
        assert trained and all(t.startswith(f"{name}-") for t in trained), (name, sorted(trained)[:5])


def test_both_policies_hot_swap_under_load_with_no_failed_request(run: dict[str, Any]) -> None:
    for name, agent in run["agents"].items():
        assert agent.failures == [], (name, agent.failures[:3])
        assert max(agent.served) >= 2 and agent.served[0] == 0, (name, agent.served[:3])
    for name, versions in run["published"].items():  # each version once, in order, across the restart
        assert versions == list(range(1, len(versions) + 1)) and len(versions) >= run["routed"][name], (name, versions)
    assert 'streamrl_gateway_policy_swaps_total{policy="speller"}' in run["metrics"]
    assert 'streamrl_gateway_policy_requests_total{policy="adder",status="200"}' in run["metrics"]


def test_a_restart_of_one_trainer_leaves_the_other_learning(run: dict[str, Any]) -> None:
    """While adder's trainer was down, speller published and was routed (the fixture waited for it) and adder
    stayed on its version; after the restart adder went on from its checkpoint, numbering on."""
    assert run["adder_while_down"] == run["adder_before"]
