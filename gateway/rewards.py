"""``POST /v1/rewards``: one reward or a list of them, validated as a whole, then sent to Kafka.

An item with a ``judge`` object (``{"trajectory_id", "group_id", "group_size", "reward"?, "judge":
{"rubric"?, "weight"?}}``) asks ``streamrl judge`` to score the trajectory with its group: it goes to the
rewards topic as a ``JudgeRequest``, which trainers never train on; the judge answers with the reward.

Either every item is valid and every one is offered to the producer, or the request gets a 4xx and
nothing is produced.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from streamrl.broker.log_producer import LogProducer
from streamrl.broker.schema import (
    JudgeRequest,
    RecordError,
    RewardRecord,
    encode,
    judge_request,
    reward_record,
)

from .proxy import JSON, BadRequest, error_response, read_body

FIELDS = frozenset(f.name for f in dataclasses.fields(RewardRecord)) - {"created", "key_id", "judged_by"}
"""What a posted reward may carry: the record's fields but its creation time and the API key's id, which
the gateway stamps, and ``judged_by``, which only the judge service sets."""
JUDGE_REQUEST_FIELDS = frozenset(("trajectory_id", "group_id", "group_size", "reward", "judge"))
"""What a posted judge request may carry (``reward``: the producer's own, mixed with the judge's score)."""
MAX_ITEMS = 10_000


def parse_reward(item: Any, where: str, key_id: str | None = None) -> RewardRecord | JudgeRequest:
    if not isinstance(item, dict):
        raise BadRequest(400, f"{where}: a reward must be an object")
    judged = "judge" in item
    unknown = set(item) - (JUDGE_REQUEST_FIELDS if judged else FIELDS)
    if unknown:
        raise BadRequest(400, f"{where}: unknown fields {sorted(unknown)}", sorted(unknown)[0])
    try:
        return judge_request(item, key_id=key_id) if judged else reward_record(item, key_id=key_id)
    except RecordError as exc:
        raise BadRequest(400, f"{where}: {exc}") from None


async def post_rewards(request: Request, producer: LogProducer | None, topic: str, max_body_bytes: int,
                       key_id: str | None = None) -> Response:
    """``key_id``: the id of the request's API key, stamped on every reward (None without keys)."""
    try:
        raw = await read_body(request, max_body_bytes)
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise BadRequest(400, f"invalid JSON: {exc}") from None
        items = body if isinstance(body, list) else [body]
        if not items or len(items) > MAX_ITEMS:
            raise BadRequest(400, f"send between 1 and {MAX_ITEMS} rewards")
        records = [parse_reward(item, f"reward {i}", key_id) for i, item in enumerate(items)]
    except BadRequest as exc:
        return error_response(exc.status, exc.message, exc.param)
    if producer is None:
        return error_response(503, "this gateway has no Kafka producer (logging is off)")
    if producer.buffered + len(records) > producer.capacity:
        return error_response(503, "the record buffer is full; retry later")
    for record in records:
        producer.offer(topic, record.trajectory_id.encode(), encode(record))
    return Response(orjson.dumps({"accepted": len(records)}), 200, media_type=JSON)
