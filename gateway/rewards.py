"""``POST /v1/rewards``: one reward or a list of them, validated as a whole, then sent to Kafka; and
``POST /v1/trajectories/end``, the end of episodes that post no reward (held-out evaluations).

An item with a ``judge`` object (``{"trajectory_id", "group_id", "group_size", "reward"?, "judge":
{"rubric"?, "weight"?}}``) asks ``streamrl judge`` to score the trajectory with its group: it goes to the
rewards topic as a ``JudgeRequest``, which trainers never train on; the judge answers with the reward.

Either every item is valid and every one is delivered, or the request gets a 4xx and nothing is
produced. The answer is a 200 only once every item is durable: acknowledged by Kafka (acks=all) or
fsynced in the gateway's spool. A 503 says some may not be: the client sends them again (a reward
delivered twice is harmless, the trainer keeps a trajectory's first).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from streamrl.broker.schema import (
    JudgeRequest,
    RecordError,
    RewardRecord,
    check_id,
    encode,
    judge_request,
    reward_record,
)
from streamrl.gateway.recording.delivery import Delivery, NotDurable

from .auth import ApiKey
from .proxy import JSON, BadRequest, error_response, read_body

FIELDS = frozenset(f.name for f in dataclasses.fields(RewardRecord)) - {"created", "key_id", "judged_by"}
"""What a posted reward may carry: the record's fields but its creation time and the API key's id, which
the gateway stamps, and ``judged_by``, which only the judge service sets."""
JUDGE_REQUEST_FIELDS = frozenset(("trajectory_id", "group_id", "group_size", "reward", "judge", "policy"))
"""What a posted judge request may carry (``reward``: the producer's own, mixed with the judge's score)."""
MAX_ITEMS = 10_000


def parse_reward(item: Any, where: str, key: ApiKey | None = None,
                 policies: tuple[str, ...] | None = None) -> RewardRecord | JudgeRequest:
    """One posted item as a record. ``policies``: the gateway's policies, which a named ``policy`` must be one
    of; a key limited to policies may name only its own, and names its one policy for an item that names none
    (with several, the item must say which: a reward is one policy's)."""
    if not isinstance(item, dict):
        raise BadRequest(400, f"{where}: a reward must be an object")
    judged = "judge" in item
    unknown = set(item) - (JUDGE_REQUEST_FIELDS if judged else FIELDS)
    if unknown:
        raise BadRequest(400, f"{where}: unknown fields {sorted(unknown)}", sorted(unknown)[0])
    policy = item.get("policy")
    if key is not None and key.policies is not None and not key.may_use(None):
        if policy is None and len(key.policies) == 1:
            policy = next(iter(key.policies))
            item = {**item, "policy": policy}
        elif policy is None:
            raise BadRequest(400, f"{where}: name the policy (this API key rewards "
                                  f"{', '.join(sorted(key.policies))})", "policy")
        elif not key.may_use(policy):
            raise BadRequest(403, f"{where}: this API key ({key.key_id}) may not reward policy {policy!r}", "policy")
    if isinstance(policy, str) and policies is not None and policy not in policies:
        raise BadRequest(400, f"{where}: policy {policy!r} is not served here (policies: {', '.join(policies)})",
                         "policy")
    key_id = key.key_id if key is not None else None
    try:
        return judge_request(item, key_id=key_id) if judged else reward_record(item, key_id=key_id)
    except RecordError as exc:
        raise BadRequest(400, f"{where}: {exc}") from None


async def post_rewards(request: Request, delivery: Delivery | None, topic: str, max_body_bytes: int,
                       timeout_s: float, key: ApiKey | None = None, policies: tuple[str, ...] | None = None,
                       accepted: Callable[[list[RewardRecord | JudgeRequest]], None] | None = None) -> Response:
    """``timeout_s``: how long the rewards may take to be durable before the answer is a 503; ``key``: the
    request's API key (None without keys), whose id is stamped on every reward and whose policies limit what
    it may reward; ``policies``: the gateway's (``parse_reward``); ``accepted`` is told the records once they
    are all durable (the metrics, the dashboard's per-version rewards)."""
    try:
        raw = await read_body(request, max_body_bytes)
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise BadRequest(400, f"invalid JSON: {exc}") from None
        items = body if isinstance(body, list) else [body]
        if not items or len(items) > MAX_ITEMS:
            raise BadRequest(400, f"send between 1 and {MAX_ITEMS} rewards")
        records = [parse_reward(item, f"reward {i}", key, policies) for i, item in enumerate(items)]
    except BadRequest as exc:
        return error_response(exc.status, exc.message, exc.param)
    if delivery is None:
        return error_response(503, "this gateway has no Kafka producer (logging is off)")
    values = [(topic, r.trajectory_id.encode(), encode(r)) for r in records]
    # off the event loop: a send may wait for Kafka's metadata, a spooled batch for its fsync
    futures = await asyncio.get_running_loop().run_in_executor(None, functools.partial(delivery.put_many, values,
                                                                                       durable=True))
    try:
        async with asyncio.timeout(timeout_s):
            await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))
    except NotDurable as exc:
        return error_response(503, f"rewards not stored durably ({exc}); send them again")
    except TimeoutError:
        return error_response(503, f"rewards not acknowledged by Kafka nor spooled within {timeout_s:g}s; "
                                   "send them again")
    if accepted is not None:
        accepted(records)
    return Response(orjson.dumps({"accepted": len(records)}), 200, media_type=JSON)


def parse_trajectory_ends(raw: bytes) -> list[str]:
    """``POST /v1/trajectories/end``'s body, ``{"trajectory_ids": [...]}``: between 1 and ``MAX_ITEMS`` ids.
    A reward ends its episode too; this is for episodes that post none (an evaluation's), so that a version
    pinned by them is let go as soon as they end rather than the gateway's ``pinned_hold_s`` later."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(400, f"invalid JSON: {exc}") from None
    if not isinstance(body, dict) or set(body) != {"trajectory_ids"}:
        raise BadRequest(400, 'send {"trajectory_ids": [...]}', "trajectory_ids")
    ids = body["trajectory_ids"]
    if not isinstance(ids, list) or not 1 <= len(ids) <= MAX_ITEMS:
        raise BadRequest(400, f"trajectory_ids must be a list of 1 to {MAX_ITEMS} ids", "trajectory_ids")
    try:
        return [check_id(i, f"trajectory_ids[{n}]") for n, i in enumerate(ids)]
    except RecordError as exc:
        raise BadRequest(400, str(exc), "trajectory_ids") from None
