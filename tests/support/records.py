"""Records built the same way by a unit test and its integration counterpart: an assembler's call, a judge's
completion, and the parts a ``LogProducer`` builds a waiting reward from (a module-level function, so that
the producer process can import it by name)."""

from __future__ import annotations

import uuid

import numpy as np

from streamrl.broker.schema import CompletionRecord, RewardRecord, encode


def call(tid: str, prompt: list[int], completion: list[int], *, gid: str | None = "g", version: int = 0,
         req: str | None = None, request: dict | None = None) -> CompletionRecord:
    lp = -np.arange(1, len(completion) + 1, dtype=np.float32) / 10
    return CompletionRecord(request_id=req or uuid.uuid4().hex, trajectory_id=tid, group_id=gid,
                            prompt_token_ids=np.array(prompt), completion_token_ids=np.array(completion),
                            logprobs=lp, policy_version=version, request=request or {})


def completion(tid: str, messages: list[dict], answer: str = "", tool_calls: list | None = None,
               gid: str | None = None, request_id: str | None = None, purpose: str = "train") -> CompletionRecord:
    return CompletionRecord(request_id=request_id or f"{tid}-{len(messages)}", trajectory_id=tid, group_id=gid,
                            prompt_token_ids=np.arange(4), completion_token_ids=np.arange(3) + 10,
                            logprobs=np.full(3, -0.5), request={"messages": messages}, response_text=answer,
                            tool_calls=tool_calls, purpose=purpose)


def reward_parts(tag: bytes, side: bytes) -> list[tuple[bytes | None, bytes]]:
    return [(tag, encode(RewardRecord(trajectory_id=tag.decode(), reward=float(len(side)))))]
