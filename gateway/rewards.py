"""``POST /v1/rewards``: one reward or a list of them, validated as a whole, then sent to Kafka.

Either every item is valid and every one is offered to the producer, or the request gets a 4xx and
nothing is produced.
"""

from __future__ import annotations

import math
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from streamrl.broker.log_producer import LogProducer
from streamrl.broker.schema import RecordError, RewardRecord, check_group_size, check_id, check_reward, encode

from .proxy import JSON, BadRequest, error_response, read_body

FIELDS = frozenset({"trajectory_id", "reward", "group_id", "group_size", "metrics"})
MAX_ITEMS = 10_000


def parse_reward(item: Any, where: str) -> RewardRecord:
    if not isinstance(item, dict):
        raise BadRequest(400, f"{where}: a reward must be an object")
    unknown = set(item) - FIELDS
    if unknown:
        raise BadRequest(400, f"{where}: unknown fields {sorted(unknown)}", sorted(unknown)[0])
    metrics = item.get("metrics") or {}
    try:
        if "trajectory_id" not in item or "reward" not in item:
            raise RecordError("missing", "trajectory_id and reward are required")
        if not isinstance(metrics, dict) or not all(
                isinstance(k, str) and not isinstance(v, bool) and isinstance(v, int | float) and math.isfinite(v)
                for k, v in metrics.items()):
            raise RecordError("bad_metrics", "metrics must map names to finite numbers")
        return RewardRecord(
            trajectory_id=check_id(item["trajectory_id"], "trajectory_id"),  # type: ignore[arg-type]
            reward=check_reward(item["reward"]),
            group_id=check_id(item.get("group_id"), "group_id", optional=True),
            group_size=check_group_size(item.get("group_size")),
            metrics={k: float(v) for k, v in metrics.items()},
        )
    except RecordError as exc:
        raise BadRequest(400, f"{where}: {exc}") from None


async def post_rewards(request: Request, producer: LogProducer | None, topic: str, max_body_bytes: int) -> Response:
    try:
        raw = await read_body(request, max_body_bytes)
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise BadRequest(400, f"invalid JSON: {exc}") from None
        items = body if isinstance(body, list) else [body]
        if not items or len(items) > MAX_ITEMS:
            raise BadRequest(400, f"send between 1 and {MAX_ITEMS} rewards")
        records = [parse_reward(item, f"reward {i}") for i, item in enumerate(items)]
    except BadRequest as exc:
        return error_response(exc.status, exc.message, exc.param)
    if producer is None:
        return error_response(503, "this gateway has no Kafka producer (logging is off)")
    if producer.buffered + len(records) > producer.capacity:
        return error_response(503, "the record buffer is full; retry later")
    for record in records:
        producer.offer(topic, record.trajectory_id.encode(), encode(record))
    return Response(orjson.dumps({"accepted": len(records)}), 200, media_type=JSON)
