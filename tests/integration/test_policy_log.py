"""The policy topic as a log of versions (``broker/policy_log.py``) and ``streamrl publish``, on the
embedded broker."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from streamrl.broker.policy_log import PolicyLog, adapter_record, publish_version
from streamrl.broker.schema import WEIGHTS_FILE, sha256_file
from streamrl.broker.topics import Topics, create_topics
from streamrl.cli import main


def adapter_dir(root: Path, content: bytes) -> Path:
    root.mkdir(parents=True)
    (root / WEIGHTS_FILE).write_bytes(content)
    return root


def test_publish_then_the_newest_version_and_the_cli(broker, tmp_path, capsys) -> None:
    topics = Topics(f"plog-{uuid.uuid4().hex[:6]}")
    create_topics(broker.bootstrap_servers, topics)
    first = adapter_dir(tmp_path / "a1", b"weights one")
    record = publish_version(broker.bootstrap_servers, topics, "agent", 1, first, "base")
    assert record.sha256 == sha256_file(first / WEIGHTS_FILE) and record.path == str(first.resolve())
    log = PolicyLog(broker.bootstrap_servers, topics)
    try:
        log.publish(adapter_record("other", 7, first, "base"))  # another policy's versions do not count
        assert log.last_version("agent") == 1 and log.last_version("nobody") == 0
    finally:
        log.close()

    second = adapter_dir(tmp_path / "a2", b"weights two")
    argv = ["publish", str(second), "--bootstrap-servers", broker.bootstrap_servers, "--base-model", "base",
            "--name", "agent", "--topic-prefix", topics.prefix]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["version"] == 2 and out["sha256"] == sha256_file(second / WEIGHTS_FILE)  # one past the newest
    log = PolicyLog(broker.bootstrap_servers, topics)
    try:
        assert log.last_version("agent") == 2
    finally:
        log.close()
    assert main(["publish", str(tmp_path), "--bootstrap-servers", broker.bootstrap_servers,
                 "--base-model", "base", "--topic-prefix", topics.prefix]) == 2  # not an adapter directory
    assert WEIGHTS_FILE in capsys.readouterr().err
