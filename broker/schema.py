"""The records every part of streamrl shares, and their wire encoding. The one schema module.

Three record kinds travel over Kafka:

* ``CompletionRecord`` (topic ``completions``, key = trajectory id): one per sampled choice, written by
  the gateway. Token ids and the sampling logprobs are the trainer's input, so they are stored exactly
  and compactly: int32 / float32 little-endian bytes, never JSON lists of numbers.
* ``RewardRecord`` (topic ``rewards``, key = trajectory id): one per scored trajectory.
* ``PolicyRecord`` (topic ``policy``, key = policy name): one per adapter version the trainer publishes.
* ``JudgeRequest`` (topic ``rewards``, key = trajectory id): "judge this trajectory with its group" instead
  of a reward; ``streamrl judge`` answers it with a ``RewardRecord``, trainers never train on it.
* ``GatewayState`` (topic ``gateways``, key = gateway id): one gateway's view of the policy versions,
  written every heartbeat; the gateways in front of the same replicas coordinate loads and unloads by it.

Wire format of a record value (all integers little-endian)::

    offset 0  3 bytes  magic b"SRL"
    offset 3  1 byte   kind (1 completion, 2 reward, 3 policy, 4 judge request, 5 gateway state)
    offset 4  1 byte   schema version of that kind (see SCHEMA_VERSIONS)
    offset 5  4 bytes  length J of the JSON header (uint32)
    offset 9  J bytes  JSON header (orjson): every field of the record's dataclass but a completion's
                       arrays, in declaration order (so a field is declared once, in the dataclass, plus
                       its reader for decoding, which the module checks at import)
    then               completion records only: prompt ids (int32 x n_prompt),
                       completion ids (int32 x n_completion), logprobs (float32 x n_completion)

A reader that meets an unknown magic, kind or version raises ``RecordError`` (with a ``reason`` code for
counting) instead of guessing, so a consumer can count and skip it. Version history:

* completion v1, reward v1, policy v1: the first versions.
* completion v2: ``purpose`` (``train``, or ``eval`` for held-out evaluation, which no trainer may train
  on). A v1 record reads as ``train``; a reader that knows only v1 refuses v2 records rather than
  train on an evaluation.
* completion v3, reward v2: ``key_id``, the id of the gateway API key the call or reward came with
  (``gateway/auth.py``; never the key itself), so a trainer can keep one tenant's data apart; None when
  the gateway checks no keys. Older records read as None; a reader that knows only the older versions
  refuses these (upgrade trainers before gateways).
* policy v2: ``publisher``, the id of the trainer (or ``streamrl publish``) that published the version;
  a gateway configured with ``trusted_publishers`` serves only their versions. Older records read as None.
* purpose ``judge`` (no version change): the judge service's own calls to a model. A reader that does not
  know it refuses the record (``bad_purpose``), so it is never trained on, by old trainers either.
* reward v3: ``judged_by`` (the id of the ``streamrl judge`` service that scored the trajectory; None:
  posted by the producer) and ``explanation`` (the judge's words). Older records read as None and "".
* judge request v1 (kind 4): the first version. A reader that does not know the kind refuses it
  (``unknown_kind``), so old trainers skip it.
* gateway state v1 (kind 5, topic ``gateways``): the first version. Only gateways read it (the
  coordination of several gateways, ``gateway/coordination.py``); any other reader refuses the kind.
* gateway state v2: ``joined_offset`` instead of ``started_at`` and ``at``: the leader is the live gateway
  that joined the log first, and liveness is judged by when the reader received a state, so no host's
  clock is compared with another's. A v1 state reads as a gateway that joined at that state's offset; a
  v1 gateway refuses v2 states (upgrade every gateway of a fleet together).
"""

from __future__ import annotations

import hashlib
import math
import struct
import time
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import orjson

MAGIC = b"SRL"
KIND_COMPLETION = 1
KIND_REWARD = 2
KIND_POLICY = 3
KIND_JUDGE_REQUEST = 4
KIND_GATEWAY_STATE = 5
SCHEMA_VERSIONS = {KIND_COMPLETION: 3, KIND_REWARD: 3, KIND_POLICY: 2, KIND_JUDGE_REQUEST: 1, KIND_GATEWAY_STATE: 2}
"""The version each kind is written in."""
READABLE_VERSIONS = {KIND_COMPLETION: (1, 2, 3), KIND_REWARD: (1, 2, 3), KIND_POLICY: (1, 2),
                     KIND_JUDGE_REQUEST: (1,), KIND_GATEWAY_STATE: (1, 2)}
"""The versions of each kind this module reads."""
PURPOSES = ("train", "eval", "judge")
"""What a completion was generated for: only ``train`` completions are trained on (``eval``: held-out
evaluation; ``judge``: the judge service scoring trajectories)."""
_HEADER = struct.Struct("<3sBBI")

MAX_ID_LENGTH = 256
"""Trajectory, group and request ids are non-empty strings of at most this many characters."""


class RecordError(ValueError):
    """A record that cannot be used. ``reason`` is a short code for metrics (e.g. ``nan_logprob``)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def check_id(value: Any, name: str, *, optional: bool = False) -> str | None:
    """Validate an id: a non-empty string of at most MAX_ID_LENGTH characters."""
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_ID_LENGTH:
        raise RecordError("bad_id", f"{name} must be a non-empty string of at most {MAX_ID_LENGTH} chars")
    return value


@dataclass(slots=True)
class CompletionRecord:
    """One sampled choice of one request, token-exact, as the gateway saw it.

    ``policy_version`` is the adapter version that served the choice (0 = the base model), so the
    trainer's staleness is exact. ``logprobs[i]`` is the log-probability of ``completion_token_ids[i]``
    under the distribution vLLM actually sampled from (``processed_logprobs``).
    """

    request_id: str
    trajectory_id: str
    prompt_token_ids: np.ndarray
    completion_token_ids: np.ndarray
    logprobs: np.ndarray
    group_id: str | None = None
    choice_index: int = 0
    model: str = ""
    policy_name: str | None = None
    policy_version: int = 0
    upstream: str = ""
    endpoint: str = "chat"
    finish_reason: str | None = None
    ttft_s: float | None = None
    total_s: float | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    request: dict[str, Any] = field(default_factory=dict)
    """What was asked, for inspection: messages (chat) or prompt (completions), tools, sampling params."""
    response_text: str = ""
    tool_calls: list[dict[str, Any]] | None = None
    created: float = field(default_factory=time.time)
    purpose: str = "train"
    """``train``; ``eval``: generated to evaluate a version on held-out problems; ``judge``: the judge
    service's call scoring trajectories. Only ``train`` is ever trained on."""
    key_id: str | None = None
    """The id of the API key the call came with (None: the gateway checks no keys)."""

    def __post_init__(self) -> None:
        self.prompt_token_ids = np.ascontiguousarray(self.prompt_token_ids, dtype=np.int32)
        self.completion_token_ids = np.ascontiguousarray(self.completion_token_ids, dtype=np.int32)
        self.logprobs = np.ascontiguousarray(self.logprobs, dtype=np.float32)


@dataclass(slots=True)
class RewardRecord:
    """The reward of one trajectory. ``group_size`` tells the trainer how many to wait for."""

    trajectory_id: str
    reward: float
    group_id: str | None = None
    group_size: int | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    key_id: str | None = None
    """The id of the API key the reward was posted with (set by the gateway, never by the poster)."""
    judged_by: str | None = None
    """The id of the ``streamrl judge`` service that scored the trajectory (None: posted by the producer);
    a judge restarting skips the trajectories it finds rewards of its own for."""
    explanation: str = ""
    """The judge's explanation of its scores of the group (``metrics`` holds only numbers)."""


JUDGE_FIELDS = frozenset(("rubric", "weight"))
"""What the ``judge`` object of a posted judge request may carry."""


@dataclass(slots=True)
class JudgeRequest:
    """A producer's request to have a trajectory scored by the judge service relative to its group,
    instead of (or mixed with) a reward of its own. ``group_size`` says how many requests make the group
    complete; without it, the group is complete after the judge's quiet period."""

    trajectory_id: str
    group_id: str | None = None
    group_size: int | None = None
    rubric: str | None = None
    """What to judge by; None: the judge's configured rubric for the group."""
    agent_reward: float | None = None
    """The producer's own reward, mixed with the judge's score: ``weight * judge + (1 - weight) * agent``."""
    weight: float | None = None
    """The judge score's weight in [0, 1] when ``agent_reward`` is given; None: the judge's default. The
    first request of a group sets the group's rule."""
    created: float = field(default_factory=time.time)
    key_id: str | None = None
    """The id of the API key the request was posted with (set by the gateway)."""


WEIGHTS_FILE = "adapter_model.safetensors"
"""The file of a published adapter directory whose sha256 ``PolicyRecord.sha256`` records."""


def sha256_file(path: str | Path) -> str:
    """The hex sha256 of a file (read in blocks by hashlib)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


@dataclass(slots=True)
class PolicyRecord:
    """A published adapter version: where its files are and the sha256 of its weights file."""

    name: str
    version: int
    path: str
    base_model: str
    step: int
    sha256: str
    metrics: dict[str, float] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    publisher: str | None = None
    """Who published it (a trainer's ``publisher_id``, ``streamrl publish --publisher``); checked by gateways
    configured with ``trusted_publishers``."""

    @property
    def served_name(self) -> str:
        """The engine-side adapter name of this version; unique per version, never reused."""
        return f"{self.name}@v{self.version}"


@dataclass(frozen=True, slots=True)
class LoadedVersion:
    """A policy version the leader gateway has loaded, and the replicas (upstream URLs) it is loaded on."""

    version: int
    replicas: tuple[str, ...]


@dataclass(slots=True)
class GatewayState:
    """One gateway's state on the coordination topic (``gateway/coordination.py`` states the protocol).

    Every gateway writes its own every heartbeat and at once when what it routes or uses changes; the
    latest one of each gateway is all that counts. ``loaded`` and ``retiring`` are the leader's word
    (empty from the others)."""

    gateway_id: str
    policy_name: str
    """The policy name the gateway serves: gateways of other names on the same topics are ignored."""
    joined_offset: int = -1
    """The offset of the gateway's first state on the coordination topic once it has read it back; -1 in
    that first state (whose own offset it is). The live gateway that joined first leads: an order every
    reader of the log agrees on, no host's clock in it."""
    seen_offset: int = -1
    """The last offset of the coordination topic the gateway had read when it wrote this."""
    routed_version: int = 0
    in_use: tuple[int, ...] = ()
    """Versions it routes or has requests in flight on (pinned ones included): not to be unloaded."""
    loaded: tuple[LoadedVersion, ...] = ()
    """Leader only: versions loaded on the replicas, oldest first; followers route among these."""
    retiring: tuple[int, ...] = ()
    """Leader only: versions about to be unloaded; gateways reading this take no new requests on them."""
    leader: bool = False
    """Written as the leader: followers take ``loaded`` and ``retiring`` from the leader's state only when
    it says so (a gateway just elected has not yet written what it took over)."""
    leaving: bool = False
    """Written once by a gateway stopping in order: it is not waited for (nor led by) any more."""


Record = CompletionRecord | RewardRecord | PolicyRecord | JudgeRequest | GatewayState


def _pack(kind: int, header: dict[str, Any], tail: bytes = b"") -> bytes:
    body = orjson.dumps(header)
    return _HEADER.pack(MAGIC, kind, SCHEMA_VERSIONS[kind], len(body)) + body + tail


_ARRAYS = ("prompt_token_ids", "completion_token_ids", "logprobs")
"""A completion's arrays travel after the JSON header as raw little-endian bytes."""


def _header_fields(cls: type) -> tuple[tuple[str, bool], ...]:
    """(name, required) of every field of a record class but its arrays, in declaration order."""
    return tuple((f.name, f.default is MISSING and f.default_factory is MISSING)
                 for f in fields(cls) if f.name not in _ARRAYS)


_HEADER_FIELDS = {cls: _header_fields(cls)
                  for cls in (CompletionRecord, RewardRecord, PolicyRecord, JudgeRequest, GatewayState)}
"""Worked out once: encoding and decoding are on the gateway's and the trainer's paths for every record."""


def _header(record: Record) -> dict[str, Any]:
    """Every field of a record but its arrays, in declaration order: the JSON header."""
    return {name: getattr(record, name) for name, _ in _HEADER_FIELDS[type(record)]}


def encode(record: Record) -> bytes:
    """Encode a record to its Kafka value bytes."""
    if isinstance(record, CompletionRecord):
        header = {**_header(record), "n_prompt": int(record.prompt_token_ids.size),
                  "n_completion": int(record.completion_token_ids.size)}
        tail = (
            record.prompt_token_ids.astype("<i4", copy=False).tobytes()
            + record.completion_token_ids.astype("<i4", copy=False).tobytes()
            + record.logprobs.astype("<f4", copy=False).tobytes()
        )
        return _pack(KIND_COMPLETION, header, tail)
    if isinstance(record, RewardRecord):
        return _pack(KIND_REWARD, _header(record))
    if isinstance(record, PolicyRecord):
        return _pack(KIND_POLICY, _header(record))
    if isinstance(record, JudgeRequest):
        return _pack(KIND_JUDGE_REQUEST, _header(record))
    if isinstance(record, GatewayState):
        return _pack(KIND_GATEWAY_STATE, _header(record))
    raise TypeError(f"not a streamrl record: {type(record).__name__}")


def decode(value: bytes | None) -> Record:
    """Decode and validate Kafka value bytes. Raises RecordError (never anything else) when unusable."""
    try:
        return _decode(value)
    except RecordError:
        raise
    except Exception as exc:  # any structural surprise is a malformed record, not a crash
        raise RecordError("malformed", f"{type(exc).__name__}: {exc}") from exc


def _decode(value: bytes | None) -> Record:
    if not value or len(value) < _HEADER.size:
        raise RecordError("malformed", "too short")
    magic, kind, version, json_len = _HEADER.unpack_from(value)
    if magic != MAGIC:
        raise RecordError("malformed", "bad magic")
    if kind not in SCHEMA_VERSIONS:
        raise RecordError("unknown_kind", str(kind))
    if version not in READABLE_VERSIONS[kind]:
        raise RecordError("unknown_version", f"kind {kind} version {version}")
    end = _HEADER.size + json_len
    if end > len(value):
        raise RecordError("malformed", "truncated header")
    h = orjson.loads(value[_HEADER.size : end])
    if not isinstance(h, dict):
        raise RecordError("malformed", "header is not an object")
    if kind == KIND_COMPLETION:
        return _decode_completion(h, memoryview(value)[end:])
    if kind == KIND_REWARD:
        return _decode_reward(h)
    if kind == KIND_JUDGE_REQUEST:
        return _decode_judge_request(h)
    if kind == KIND_GATEWAY_STATE:
        return GatewayState(**_read_header(GatewayState, h, _GATEWAY_STATE_READERS))
    return _decode_policy(h)


def _decode_completion(h: dict[str, Any], tail: memoryview) -> CompletionRecord:
    n_prompt, n_completion = h["n_prompt"], h["n_completion"]
    if not (isinstance(n_prompt, int) and isinstance(n_completion, int)) or n_prompt < 0 or n_completion < 0:
        raise RecordError("malformed", "bad array lengths")
    if len(tail) != 4 * (n_prompt + 2 * n_completion):
        raise RecordError("length_mismatch", f"{len(tail)} tail bytes for {n_prompt}+{n_completion} tokens")
    arrays = np.frombuffer(tail, dtype="<i4", count=n_prompt + n_completion)
    logprobs = np.frombuffer(tail, dtype="<f4", offset=4 * (n_prompt + n_completion))
    if not np.isfinite(logprobs).all():
        raise RecordError("nan_logprob", "logprobs must be finite")
    return CompletionRecord(prompt_token_ids=arrays[:n_prompt], completion_token_ids=arrays[n_prompt:],
                            logprobs=logprobs, **_read_header(CompletionRecord, h, _COMPLETION_READERS))


def _read_header(cls: type, h: dict[str, Any], readers: dict[str, Any]) -> dict[str, Any]:
    """A record's fields from its JSON header, each through its reader: a field the header lacks takes
    its default (``created``: 0.0, unknown), one without a default is an error."""
    values: dict[str, Any] = {}
    for name, required in _HEADER_FIELDS[cls]:
        if name in h:
            read = readers[name]
            values[name] = h[name] if read is None else read(h[name])
        elif name == "created":
            values[name] = 0.0
        elif required:
            raise RecordError("malformed", f"{name} missing")
    return values


def _policy_version(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise RecordError("malformed", "policy_version must be a non-negative int")
    return value


_COMPLETION_READERS: dict[str, Any] = {
    "request_id": str, "trajectory_id": lambda v: check_id(v, "trajectory_id"),
    "group_id": lambda v: check_id(v, "group_id", optional=True), "choice_index": int, "model": str,
    "policy_name": None, "policy_version": _policy_version, "upstream": str, "endpoint": str,
    "finish_reason": None, "ttft_s": None, "total_s": None, "usage": lambda v: v or {},
    "request": lambda v: v or {}, "response_text": lambda v: v or "", "tool_calls": None, "created": float,
    "purpose": lambda v: check_purpose(v), "key_id": lambda v: check_id(v, "key_id", optional=True),
}
"""How each header field of a completion is read back (and checked; None: taken as it is). A field added
to ``CompletionRecord`` without an entry here fails at import."""


def check_purpose(value: Any) -> str:
    if value not in PURPOSES:
        raise RecordError("bad_purpose", f"purpose must be one of {', '.join(PURPOSES)}, got {value!r}")
    return value


def check_reward(value: Any) -> float:
    """A reward must be a finite number (bools are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RecordError("non_finite_reward", f"reward must be a finite number, got {value!r}")
    return float(value)


def check_group_size(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4096:
        raise RecordError("bad_group_size", "group_size must be an integer in [1, 4096]")
    return value


def check_metrics(value: Any) -> dict[str, float]:
    """A reward's metrics: names mapped to finite numbers (bools are not numbers here)."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
            isinstance(k, str) and not isinstance(v, bool) and isinstance(v, int | float) and math.isfinite(v)
            for k, v in value.items()):
        raise RecordError("bad_metrics", "metrics must map names to finite numbers")
    return {k: float(v) for k, v in value.items()}


MAX_TEXT_LENGTH = 65_536
"""A rubric or an explanation is a string of at most this many characters."""


def check_text(value: Any, name: str, *, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str) or len(value) > MAX_TEXT_LENGTH:
        raise RecordError("bad_text", f"{name} must be a string of at most {MAX_TEXT_LENGTH} chars")
    return value


def check_weight(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
        raise RecordError("bad_weight", f"weight must be a number in [0, 1], got {value!r}")
    return float(value)


def reward_record(fields: dict[str, Any], created: float | None = None, key_id: str | None = None,
                  judged_by: str | None = None) -> RewardRecord:
    """A ``RewardRecord`` from its fields, every rule of a reward checked here and nowhere else: the
    gateway's ``POST /v1/rewards`` items, the producer SDK's bodies and decoded records all come through.
    ``key_id`` and ``judged_by`` are passed apart: the gateway sets the first from the request's key, the
    judge service the second; never a posted item."""
    if "trajectory_id" not in fields or "reward" not in fields:
        raise RecordError("missing", "trajectory_id and reward are required")
    return RewardRecord(
        trajectory_id=check_id(fields["trajectory_id"], "trajectory_id"),  # type: ignore[arg-type]
        reward=check_reward(fields["reward"]),
        group_id=check_id(fields.get("group_id"), "group_id", optional=True),
        group_size=check_group_size(fields.get("group_size")),
        metrics=check_metrics(fields.get("metrics")),
        **({} if created is None else {"created": created}),
        key_id=check_id(key_id, "key_id", optional=True),
        judged_by=check_id(judged_by, "judged_by", optional=True),
        explanation=check_text(fields.get("explanation") or "", "explanation"),  # type: ignore[arg-type]
    )


def _decode_reward(h: dict[str, Any]) -> RewardRecord:
    return reward_record(h, created=float(h.get("created", 0.0)), key_id=h.get("key_id"),
                         judged_by=h.get("judged_by"))


def judge_request(fields: dict[str, Any], created: float | None = None, key_id: str | None = None) -> JudgeRequest:
    """A ``JudgeRequest`` from a posted item (``{"trajectory_id", "group_id", "group_size", "reward",
    "judge": {"rubric", "weight"}}``) or a decoded header; every rule of a judge request is checked here."""
    if "trajectory_id" not in fields:
        raise RecordError("missing", "trajectory_id is required")
    judge = fields.get("judge", {})
    if judge is None:
        judge = {}
    if not isinstance(judge, dict) or set(judge) - JUDGE_FIELDS:
        raise RecordError("bad_judge", f"judge must be an object with at most {sorted(JUDGE_FIELDS)}")
    rubric = judge.get("rubric", fields.get("rubric"))
    weight = judge.get("weight", fields.get("weight"))
    agent = fields.get("reward", fields.get("agent_reward"))
    return JudgeRequest(
        trajectory_id=check_id(fields["trajectory_id"], "trajectory_id"),  # type: ignore[arg-type]
        group_id=check_id(fields.get("group_id"), "group_id", optional=True),
        group_size=check_group_size(fields.get("group_size")),
        rubric=check_text(rubric, "rubric", optional=True),
        agent_reward=None if agent is None else check_reward(agent),
        weight=check_weight(weight),
        **({} if created is None else {"created": created}),
        key_id=check_id(key_id, "key_id", optional=True),
    )


def _decode_judge_request(h: dict[str, Any]) -> JudgeRequest:
    return judge_request(h, created=float(h.get("created", 0.0)), key_id=h.get("key_id"))


def _decode_policy(h: dict[str, Any]) -> PolicyRecord:
    return PolicyRecord(**_read_header(PolicyRecord, h, _POLICY_READERS))


def _published_version(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RecordError("malformed", "policy version must be an int >= 1")
    return value


_POLICY_READERS: dict[str, Any] = {
    "name": lambda v: check_id(v, "name"), "version": _published_version, "path": str, "base_model": str,
    "step": int, "sha256": str, "metrics": lambda v: v or {}, "created": float,
    "publisher": lambda v: check_id(v, "publisher", optional=True),
}



def _versions(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise RecordError("malformed", "versions must be a list")
    return tuple(_published_version(v) for v in value)


def _loaded(value: Any) -> tuple[LoadedVersion, ...]:
    if not isinstance(value, list):
        raise RecordError("malformed", "loaded must be a list")
    out = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("replicas"), list) \
                or not all(isinstance(u, str) for u in item["replicas"]):
            raise RecordError("malformed", "a loaded version is {version, replicas: [url, ...]}")
        out.append(LoadedVersion(_published_version(item.get("version")), tuple(item["replicas"])))
    return tuple(out)


def _offset(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise RecordError("malformed", "an offset must be an int >= -1")
    return value


def _time(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RecordError("malformed", "a time must be a finite number")
    return float(value)


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise RecordError("malformed", "leader and leaving must be bools")
    return value


_GATEWAY_STATE_READERS: dict[str, Any] = {
    "gateway_id": lambda v: check_id(v, "gateway_id"), "policy_name": lambda v: check_id(v, "policy_name"),
    "joined_offset": _offset, "seen_offset": _offset, "routed_version": _policy_version, "in_use": _versions,
    "loaded": _loaded, "retiring": _versions, "leader": _flag, "leaving": _flag,
}

for _cls, _readers in ((CompletionRecord, _COMPLETION_READERS), (PolicyRecord, _POLICY_READERS),
                       (GatewayState, _GATEWAY_STATE_READERS)):
    if set(_readers) != {name for name, _ in _HEADER_FIELDS[_cls]}:
        raise RuntimeError(f"{_cls.__name__}: every header field needs exactly one reader")
