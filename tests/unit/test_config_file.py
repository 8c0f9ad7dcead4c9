"""One loader for every part's typed configuration (``streamrl.config_file``): defaults < file < flags,
through the gateway's and the trainer's own entry points."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from streamrl.gateway.cli import add_arguments, config_from_args
from streamrl.gateway.config import GatewayConfig
from streamrl.trainer.config import TrainerConfig
from streamrl.usage import UsageError


def gateway_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_every_gateway_field_can_come_from_a_file_and_flags_override_it(tmp_path: Path) -> None:
    path = tmp_path / "gw.toml"
    path.write_text('[gateway]\nupstreams = ["http://a:1/"]\n'
                    'health_interval_s = 0.25\nproducer_process = false\nport = 9000\n'
                    '[gateway.extra_headers]\nAuthorization = "Bearer x"\n[gateway.kafka]\nbootstrap_servers = "k:9092"\n')
    c = config_from_args(gateway_args("--config", str(path), "--port", "9100", "--no-token-capture"))
    assert (c.upstreams, c.kafka.bootstrap_servers, c.port, c.host) == (("http://a:1",), "k:9092", 9100, "127.0.0.1")
    assert (c.health_interval_s, c.producer_process, c.token_capture) == (0.25, False, False)
    assert c.extra_headers == {"Authorization": "Bearer x"}
    json_path = tmp_path / "gw.json"  # JSON, without a table
    json_path.write_text(json.dumps({"upstreams": ["http://b"], "kafka": {"bootstrap_servers": "k:1"}, "record_request": False}))
    assert config_from_args(gateway_args("--config", str(json_path))).record_request is False


def test_the_gateway_refuses_an_incomplete_or_unknown_configuration(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"--bootstrap-servers .* or --no-logging"):
        config_from_args(gateway_args("--upstream", "http://b"))
    assert config_from_args(gateway_args("--upstream", "http://b", "--no-logging")).kafka.bootstrap_servers is None
    with pytest.raises(UsageError, match=r"give --upstream URL"):
        config_from_args(gateway_args("--bootstrap-servers", "k:1"))
    with pytest.raises(UsageError, match=r"\[gateway\]: update_mode 'in-flight' needs token_capture"):
        config_from_args(gateway_args("--upstream", "http://b", "--no-logging", "--update-mode", "in-flight",
                                      "--no-token-capture"))
    path = tmp_path / "bad.toml"
    path.write_text('[gateway]\nupstreams = ["http://a"]\nhealth_intervall_s = 1\n')
    with pytest.raises(UsageError, match=r"bad.toml:3:1: unknown option 'health_intervall_s' in \[gateway\] \(did you mean health_interval_s\?\)"):
        GatewayConfig.load(path)


def test_the_trainer_reads_its_table_the_same_way(tmp_path: Path) -> None:
    path = tmp_path / "all.toml"
    path.write_text('[trainer.optim]\nlearning_rate = 0.004\n[trainer.feed]\nbacklog = "wait"\n[gateway]\nport = 1\n')
    c = TrainerConfig.load(path, learning_rate=None, max_step_tokens=0)
    assert (c.optim.learning_rate, c.feed.backlog, c.feed.max_step_tokens) == (0.004, "wait", 0)
