"""The shared record schema: round trips, compactness and every rejection reason."""

from __future__ import annotations

import struct

import numpy as np
import orjson
import pytest

from streamrl.broker import schema
from streamrl.broker.schema import CompletionRecord, PolicyRecord, RecordError, RewardRecord, decode, encode


def completion(n_prompt: int = 5, n_completion: int = 3, **kw) -> CompletionRecord:
    return CompletionRecord(
        request_id="req-1", trajectory_id="traj-1", group_id="g",
        prompt_token_ids=np.arange(n_prompt), completion_token_ids=np.arange(100, 100 + n_completion),
        logprobs=-np.linspace(0.1, 1.0, n_completion), policy_version=3, created=0.0, **kw,
    )


def test_completion_round_trip_is_exact() -> None:
    rec = completion(request={"messages": [{"role": "user", "content": "hi"}]}, response_text="yo")
    out = decode(encode(rec))
    assert isinstance(out, CompletionRecord)
    assert out.prompt_token_ids.tolist() == [0, 1, 2, 3, 4]
    assert out.completion_token_ids.tolist() == [100, 101, 102]
    assert out.logprobs.dtype == np.float32
    np.testing.assert_array_equal(out.logprobs, rec.logprobs)
    assert (out.trajectory_id, out.group_id, out.policy_version) == ("traj-1", "g", 3)
    assert out.request["messages"][0]["content"] == "hi" and out.response_text == "yo"


def test_arrays_are_binary_not_json() -> None:
    small, big = encode(completion(10, 10)), encode(completion(10, 1010))
    # 4 bytes id + 4 bytes logprob per sampled token, plus two more digits in the JSON count
    assert len(big) - len(small) == 1000 * 8 + 2


def test_reward_and_policy_round_trip() -> None:
    r = decode(encode(RewardRecord("t", 1.5, group_id="g", group_size=4, metrics={"acc": 1.0})))
    assert r == RewardRecord("t", 1.5, group_id="g", group_size=4, metrics={"acc": 1.0}, created=r.created)
    p = decode(encode(PolicyRecord("policy", 2, "/a/v2", "base", 7, "ab" * 32)))
    assert isinstance(p, PolicyRecord) and p.served_name == "policy@v2"


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (b"", "malformed"),
        (b"XXX\x01\x01\x00\x00\x00\x00", "malformed"),
        (b"SRL\x09\x01\x00\x00\x00\x00", "unknown_kind"),
        (b"SRL\x01\x07\x00\x00\x00\x00", "unknown_version"),
        (b"SRL\x01\x01\xff\x00\x00\x00{}", "malformed"),
    ],
)
def test_structural_rejections(value: bytes, reason: str) -> None:
    with pytest.raises(RecordError) as err:
        decode(value)
    assert err.value.reason == reason


def test_length_mismatch_and_nan_logprobs_are_rejected() -> None:
    good = encode(completion())
    with pytest.raises(RecordError) as err:
        decode(good[:-4])
    assert err.value.reason == "length_mismatch"
    bad = completion()
    bad.logprobs[1] = np.nan
    with pytest.raises(RecordError) as err:
        decode(encode(bad))
    assert err.value.reason == "nan_logprob"


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), "1", True, None])
def test_non_finite_or_non_numeric_reward_is_rejected(reward) -> None:
    body = schema._pack(schema.KIND_REWARD, {"trajectory_id": "t", "reward": reward})
    with pytest.raises(RecordError) as err:
        decode(body)
    assert err.value.reason == "non_finite_reward"


def test_bad_ids_are_rejected() -> None:
    for tid in ["", "x" * 257, 5]:
        body = schema._pack(schema.KIND_REWARD, {"trajectory_id": tid, "reward": 1.0})
        with pytest.raises(RecordError):
            decode(body)


def test_header_layout_is_documented() -> None:
    magic, kind, version, n = struct.unpack_from("<3sBBI", encode(completion()))
    assert (magic, kind, version) == (b"SRL", schema.KIND_COMPLETION, 4) and n > 0


def test_purpose_round_trips_and_a_v1_completion_reads_as_train() -> None:
    assert decode(encode(completion(purpose="eval"))).purpose == "eval"
    v2 = encode(completion())
    magic, kind, _, n = struct.unpack_from("<3sBBI", v2)
    header = orjson.loads(v2[9:9 + n])
    del header["purpose"]
    body = orjson.dumps(header)
    v1 = struct.pack("<3sBBI", magic, kind, 1, len(body)) + body + v2[9 + n:]  # as a v1 writer wrote it
    assert decode(v1).purpose == "train"
    bad = struct.pack("<3sBBI", magic, kind, 2, len(b := orjson.dumps({**header, "purpose": "x"}))) + b + v2[9 + n:]
    with pytest.raises(RecordError) as err:
        decode(bad)
    assert err.value.reason == "bad_purpose"


def test_each_record_field_is_declared_once_and_travels() -> None:
    """The JSON header is the dataclass's fields in order (a completion's arrays aside), and every field has
    exactly one reader; a record decoded from an old header without optional fields takes their defaults."""
    import dataclasses


    raw = encode(completion())
    n = struct.unpack_from("<3sBBI", raw)[3]
    header = orjson.loads(raw[9:9 + n])
    names = [f.name for f in dataclasses.fields(schema.CompletionRecord) if f.name not in schema._ARRAYS]
    assert list(header) == [*names, "n_prompt", "n_completion"]
    assert set(schema._COMPLETION_READERS) == set(names)
    sparse = decode(schema._pack(schema.KIND_COMPLETION, {"request_id": "r", "trajectory_id": "t",
                                                          "n_prompt": 0, "n_completion": 0}))
    assert (sparse.created, sparse.purpose, sparse.policy_version, sparse.usage) == (0.0, "train", 0, {})


def older(raw: bytes, version: int, drop: str) -> bytes:
    """``raw`` as a writer of ``version`` wrote it: that version's number, without the field added since."""
    magic, kind, _, n = struct.unpack_from("<3sBBI", raw)
    header = orjson.loads(raw[9:9 + n])
    del header[drop]
    body = orjson.dumps(header)
    return struct.pack("<3sBBI", magic, kind, version, len(body)) + body + raw[9 + n:]


def test_key_id_travels_and_older_records_read_as_none() -> None:
    """completion v3 / reward v2 carry the API key's id; v2 completions and v1 rewards (bytes as their
    writers made them) still decode, with no key id."""
    c = decode(encode(completion(key_id="team-a")))
    assert c.key_id == "team-a"
    assert decode(older(encode(completion(key_id="team-a")), 2, "key_id")).key_id is None
    r = RewardRecord("t", 1.0, key_id="team-b")
    assert decode(encode(r)).key_id == "team-b"
    old_reward = older(encode(r), 1, "key_id")
    assert old_reward[4] == 1 and decode(old_reward) == RewardRecord("t", 1.0, created=r.created)
    for record in (completion(key_id=""), RewardRecord("t", 1.0, key_id="x" * 257)):
        with pytest.raises(RecordError) as err:
            decode(encode(record))
        assert err.value.reason == "bad_id"


def test_policy_publisher_travels_and_a_v1_policy_reads_as_none() -> None:
    p = PolicyRecord("policy", 2, "/a/v2", "base", 7, "ab" * 32, publisher="streamrl-trainer.policy")
    assert decode(encode(p)).publisher == "streamrl-trainer.policy"
    v1 = older(encode(p), 1, "publisher")
    assert v1[4] == 1 and decode(v1).publisher is None and decode(v1).version == 2


def test_a_posted_reward_cannot_choose_its_key_id() -> None:
    """The gateway sets ``key_id`` from the request's key; a posted item naming one is an unknown field."""
    from streamrl.gateway.rewards import FIELDS

    assert "key_id" not in FIELDS and "created" not in FIELDS


def test_reward_v3_carries_the_judge_and_a_v2_reward_reads_without() -> None:
    r = RewardRecord("t", 0.7, group_id="g", judged_by="judge", explanation="T1 answers it")
    v3 = older(encode(r), 3, "policy")
    assert v3[4] == 3 and decode(v3) == r
    v2 = older(older(v3, 2, "explanation"), 2, "judged_by")
    assert decode(v2) == RewardRecord("t", 0.7, group_id="g", created=r.created)


def test_reward_v4_and_judge_request_v2_name_the_policy_and_older_ones_read_as_not_said() -> None:
    r = RewardRecord("t", 0.7, group_id="g", policy="support")
    raw = encode(r)
    assert raw[4] == 4 and decode(raw) == r
    assert decode(older(raw, 3, "policy")).policy is None
    req = schema.JudgeRequest("t", group_id="g", policy="sql")
    raw = encode(req)
    assert raw[4] == 2 and decode(raw) == req
    assert decode(older(raw, 1, "policy")).policy is None
    for bad in ("support@v3", "", 7):
        with pytest.raises(RecordError) as err:
            schema.reward_record({"trajectory_id": "t", "reward": 1.0, "policy": bad})
        assert err.value.reason == "bad_id"


def test_a_judge_request_is_a_kind_of_its_own_and_purpose_judge_reads_back() -> None:
    req = schema.JudgeRequest("t", group_id="g", group_size=4, rubric="be right", agent_reward=0.5, weight=0.2)
    raw = encode(req)
    assert (raw[3], raw[4]) == (schema.KIND_JUDGE_REQUEST, 2) and decode(raw) == req
    assert decode(encode(completion(purpose="judge"))).purpose == "judge"
    with pytest.raises(RecordError) as err:  # a judge request never passes for a reward
        schema.reward_record({"trajectory_id": "t", "judge": {}})
    assert err.value.reason == "missing"


def test_gateway_state_round_trips_and_a_malformed_one_is_refused() -> None:
    state = schema.GatewayState("gw-1", "policy", joined_offset=7, seen_offset=41, routed_version=3, in_use=(2, 3),
                                loaded=(schema.LoadedVersion(2, ("http://a", "http://b")),
                                        schema.LoadedVersion(3, ("http://a",))),
                                retiring=(1,), leader=True)
    raw = encode(state)
    assert (raw[3], raw[4]) == (schema.KIND_GATEWAY_STATE, 2) and decode(raw) == state
    header = orjson.loads(raw[9:9 + struct.unpack_from("<3sBBI", raw)[3]])
    for field, bad in (("loaded", [{"version": 0, "replicas": []}]), ("loaded", [{"version": 2, "replicas": [1]}]),
                       ("in_use", [1.5]), ("seen_offset", -2), ("leader", 1), ("gateway_id", ""),
                       ("joined_offset", -2), ("joined_offset", 1.0)):
        with pytest.raises(RecordError):
            decode(schema._pack(schema.KIND_GATEWAY_STATE, {**header, field: bad}))
    minimal = decode(schema._pack(schema.KIND_GATEWAY_STATE, {"gateway_id": "g", "policy_name": "p"}))
    assert (minimal.loaded, minimal.in_use, minimal.leader, minimal.leaving) == ((), (), False, False)
    # a v1 state (started_at and at, no joined_offset) reads as a gateway joining at that state's offset
    v1 = orjson.dumps({"gateway_id": "g", "policy_name": "p", "started_at": 1.0, "at": 2.0, "routed_version": 3})
    old = decode(struct.pack("<3sBBI", schema.MAGIC, schema.KIND_GATEWAY_STATE, 1, len(v1)) + v1)
    assert (old.joined_offset, old.routed_version) == (-1, 3)


def test_version_spans_round_trip_and_give_each_tokens_version() -> None:
    moved = completion(n_completion=6, version_spans=[(0, 3), (4, 5)])  # policy_version 3
    back = decode(encode(moved))
    assert back.version_spans == [(0, 3), (4, 5)]
    assert schema.token_versions(back).tolist() == [3, 3, 3, 3, 5, 5]
    assert schema.token_versions(completion(n_completion=2)).tolist() == [3, 3]
    plain = encode(completion())
    header = orjson.loads(plain[9:9 + struct.unpack_from("<I", plain, 5)[0]])
    assert header["version_spans"] is None  # a request that never moved says nothing more


@pytest.mark.parametrize("spans", [[], [[1, 2]], [[0, 1], [0, 2]], [[0, 1], [3]], [[0, -1]], [[0, True]], "x"])
def test_malformed_version_spans_are_refused(spans) -> None:
    body = encode(completion(n_completion=6))

    def with_spans(spans: object) -> bytes:
        value = body.replace(b'"version_spans":null', b'"version_spans":' + orjson.dumps(spans))
        return value[:5] + struct.pack("<I", struct.unpack_from("<I", body, 5)[0] + len(value) - len(body)) + value[9:]

    assert decode(with_spans([[0, 1], [2, 2]])).version_spans == [(0, 1), (2, 2)]  # the edit itself is sound
    with pytest.raises(RecordError):
        decode(with_spans(spans))


def test_a_version_3_completion_reads_with_no_spans() -> None:
    body = bytearray(encode(completion()))
    body[4] = 3
    assert decode(bytes(body)).version_spans is None
