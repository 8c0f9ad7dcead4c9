"""The HTTP acknowledgement of ``streamrl batches`` (``trainer/batches_ack.py``) without a broker: the moments
the integration tests cannot time, a stop while an acknowledgement waits and a failure to record one."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from streamrl.trainer.batches_ack import HttpAcks, parse_ack, read_ack


@pytest.fixture
def acks(tmp_path: Path) -> Iterator[HttpAcks]:
    a = HttpAcks(tmp_path / "ack.json", "127.0.0.1", 0)
    yield a
    a.close()


def post_in_thread(url: str, body: dict) -> tuple[threading.Thread, list[httpx.Response]]:
    out: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: out.append(httpx.post(f"{url}/ack", json=body, timeout=30)))
    thread.start()
    return thread, out


def test_the_answer_comes_once_the_stream_has_recorded_the_acknowledgement(acks: HttpAcks, tmp_path: Path) -> None:
    stop = threading.Event()
    acks.expect(1, 0)
    thread, out = post_in_thread(acks.url, {"seq": 1, "adapter_version": 2})
    assert acks.wait(1, stop) == 2
    assert read_ack(tmp_path / "ack.json") == (1, 2)  # the file channel's record, written before the answer
    assert not out and thread.is_alive()  # nothing answered until the stream has acknowledged it itself
    acks.settled(1)
    thread.join(30)
    assert out[0].status_code == 200 and out[0].json() == {"seq": 1, "adapter_version": 2, "already": False}
    assert httpx.get(f"{acks.url}/health").json() == {"status": "ok", "awaiting": None,
                                                       "acknowledged": {"seq": 1, "adapter_version": 2}}


def test_a_failure_to_record_is_a_500_and_a_stop_a_503(acks: HttpAcks) -> None:
    stop = threading.Event()
    acks.expect(1, 0)
    thread, out = post_in_thread(acks.url, {"seq": 1, "adapter_version": 1})
    assert acks.wait(1, stop) == 1
    acks.settled(1, error="OSError('disk full')")
    thread.join(30)
    assert out[0].status_code == 500 and "disk full" in out[0].json()["error"]
    assert httpx.get(f"{acks.url}/health").json()["awaiting"] == 1  # still awaiting it
    stop.set()
    assert acks.wait(1, stop) is None  # stopping: the stream stops waiting...
    thread, out = post_in_thread(acks.url, {"seq": 1, "adapter_version": 1})
    while acks._posted is None:  # (the call is in, waiting for the stream)
        threading.Event().wait(0.01)
    acks.close()  # ...and a call that came in meanwhile is told to send it again
    thread.join(30)
    assert out[0].status_code == 503 and "send it again" in out[0].json()["error"]


@pytest.mark.parametrize(("body", "says"), [
    (b"", "not JSON"), (b"\xff", "not JSON"), (b"3", "JSON object"),
    (json.dumps({"seq": 1, "adapter_version": 1, "version": 2}).encode(), "disagree"),
    (json.dumps({"seq": 0, "adapter_version": 1}).encode(), "seq must be an integer >= 1"),
    (json.dumps({"seq": 1, "adapter_version": -1}).encode(), "adapter_version must be an integer >= 0"),
    (json.dumps({"seq": 1.0, "adapter_version": 1}).encode(), "seq must be an integer"),
])
def test_malformed_acknowledgements_say_what_is_wrong(body: bytes, says: str) -> None:
    got = parse_ack(body)
    assert isinstance(got, str) and says in got


def test_both_names_of_the_version_are_taken() -> None:
    assert parse_ack(b'{"seq": 3, "version": 2}') == parse_ack(b'{"seq": 3, "adapter_version": 2}') == (3, 2)
