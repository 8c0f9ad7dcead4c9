"""The gateway's OpenAPI document (``GET /openapi.json``), for API explorers, client generators and fuzzers.

The routes read raw bytes: the proxy checks only what it relies on and hands the rest to vLLM, with no
model parsing on the request path. So FastAPI cannot derive the request bodies from the handlers, and
they are declared here: the fields the gateway reads and the common OpenAI ones vLLM takes. Other fields
are allowed (``additionalProperties``), since vLLM accepts its own extensions and answers 400 for what
it does not know. The reward body follows ``broker.schema.reward_record``, the one place its rules live.
"""

from __future__ import annotations

from typing import Any

from streamrl.broker.schema import MAX_ID_LENGTH, MAX_TEXT_LENGTH, PURPOSES

from .rewards import MAX_ITEMS

_ID = {"type": "string", "minLength": 1, "maxLength": MAX_ID_LENGTH}
_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
        "code": {"type": ["integer", "string", "null"]}}}},
}
_METADATA = {
    "type": "object",
    "description": "streamrl's tags (taken off before the request goes to vLLM); the X-Trajectory-Id, "
                   "X-Group-Id and X-Purpose headers say the same.",
    "properties": {"trajectory_id": _ID, "group_id": _ID, "purpose": {"enum": list(PURPOSES)}},
}
_SAMPLING: dict[str, Any] = {
    "model": {"type": "string", "minLength": 1,
              "description": "the policy name (its newest version), `policy@vN` (a pinned version) or a base model"},
    "max_tokens": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "n": {"type": "integer", "minimum": 1},
    "seed": {"type": "integer"},
    "stream": {"type": "boolean"},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4}]},
    "metadata": _METADATA,
}
_CHAT = {
    "type": "object",
    "required": ["model", "messages"],
    "properties": {
        **_SAMPLING,
        "messages": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["role", "content"],
            "properties": {"role": {"enum": ["system", "user", "assistant"]}, "content": {"type": "string"}}}},
        "logprobs": {"type": "boolean"},
        "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 20},
    },
}
_COMPLETIONS = {
    "type": "object",
    "required": ["model", "prompt"],
    "properties": {
        **_SAMPLING,
        "prompt": {"oneOf": [
            {"type": "string"},
            {"type": "array", "minItems": 1, "items": {"type": "string"}},
            {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
        ]},
        "logprobs": {"type": "integer", "minimum": 0, "maximum": 5},
        "echo": {"type": "boolean"},
    },
}
_REWARD = {
    "type": "object",
    "required": ["trajectory_id", "reward"],
    "additionalProperties": False,
    "properties": {
        "trajectory_id": _ID,
        "reward": {"type": "number", "description": "a finite number"},
        "group_id": _ID,
        "group_size": {"type": "integer", "minimum": 1, "maximum": 4096},
        "metrics": {"type": "object", "additionalProperties": {"type": "number"}},
        "explanation": {"type": "string", "maxLength": MAX_TEXT_LENGTH},
    },
}
_JUDGE_REQUEST = {
    "type": "object",
    "description": "Ask streamrl judge to score the trajectory relative to its group (docs/judge.md)",
    "required": ["trajectory_id", "judge"],
    "additionalProperties": False,
    "properties": {
        "trajectory_id": _ID,
        "group_id": _ID,
        "group_size": {"type": "integer", "minimum": 1, "maximum": 4096},
        "reward": {"type": "number", "description": "the producer's own reward, mixed with the judge's score"},
        "judge": {"type": "object", "additionalProperties": False, "properties": {
            "rubric": {"type": "string", "maxLength": MAX_TEXT_LENGTH},
            "weight": {"type": "number", "minimum": 0, "maximum": 1}}},
    },
}
_ITEM = {"oneOf": [{"$ref": "#/components/schemas/Reward"}, {"$ref": "#/components/schemas/JudgeRequest"}]}
_REWARDS = {"oneOf": [_ITEM, {"type": "array", "minItems": 1, "maxItems": MAX_ITEMS, "items": _ITEM}]}


def _errors(*statuses: int) -> dict[str, Any]:
    return {str(s): {"description": "an OpenAI-style error",
                     "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
            for s in statuses}


def _generate(schema: str, summary: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}},
        "responses": {
            "200": {"description": "vLLM's answer, unchanged (a server-sent event stream with `stream`)",
                    "content": {"application/json": {"schema": {"type": "object"}},
                                "text/event-stream": {"schema": {"type": "string"}}}},
            **_errors(400, 401, 403, 404, 413, 502, 503, 504),
        },
    }}


def openapi_document(title: str, version: str) -> dict[str, Any]:
    """The document for this gateway: its routes, their bodies and their errors."""
    json_object = {"application/json": {"schema": {"type": "object"}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "components": {
            "schemas": {"Error": _ERROR, "ChatCompletionRequest": _CHAT, "CompletionRequest": _COMPLETIONS,
                        "Reward": _REWARD, "JudgeRequest": _JUDGE_REQUEST},
            "securitySchemes": {"apiKey": {"type": "http", "scheme": "bearer",
                                           "description": "needed when the gateway has API keys"}},
        },
        "security": [{}, {"apiKey": []}],
        "paths": {
            "/v1/chat/completions": _generate("ChatCompletionRequest", "Chat completion through the policy"),
            "/v1/completions": _generate("CompletionRequest", "Text completion through the policy"),
            "/v1/rewards": {"post": {
                "summary": "One reward or a list of them (all valid, or none is taken)",
                "requestBody": {"required": True, "content": {"application/json": {"schema": _REWARDS}}},
                "responses": {
                    "200": {"description": "how many were accepted", "content": {"application/json": {"schema": {
                        "type": "object", "required": ["accepted"],
                        "properties": {"accepted": {"type": "integer"}}}}}},
                    **_errors(400, 401, 403, 413, 503),
                },
            }},
            "/v1/trajectories/end": {"post": {
                "summary": "Episodes that post no reward ended: the versions they pinned are let go",
                "requestBody": {"required": True, "content": {"application/json": {"schema": {
                    "type": "object", "required": ["trajectory_ids"], "additionalProperties": False,
                    "properties": {"trajectory_ids": {"type": "array", "minItems": 1, "maxItems": MAX_ITEMS,
                                                      "items": {"type": "string", "minLength": 1}}}}}}},
                "responses": {
                    "200": {"description": "how many holds on pinned versions ended",
                            "content": {"application/json": {"schema": {
                                "type": "object", "required": ["ended"],
                                "properties": {"ended": {"type": "integer"}}}}}},
                    **_errors(400, 401, 403, 413),
                },
            }},
            "/v1/models": {"get": {"summary": "The policy, its versions and the base models",
                                   "responses": {"200": {"description": "OpenAI's model list",
                                                         "content": json_object}, **_errors(401, 403)}}},
            "/health": {"get": {"summary": "Liveness; detail with an admin key",
                                "responses": {"200": {"description": "state", "content": json_object}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics",
                                 "responses": {"200": {"description": "text exposition format",
                                                       "content": {"text/plain": {"schema": {"type": "string"}}}},
                                               **_errors(401, 403)}}},
        },
    }
