"""The call to the judge model through any OpenAI-compatible endpoint, with retries.

An answer the strict parser refuses is asked again, after a pause that doubles, ``max_attempts`` times in
all; then ``JudgeFailed``. A network error or a 5xx/429 is no fault of the answer: it is retried until it
succeeds or the service stops (the group would otherwise be lost), at most ``max_backoff_s`` apart.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

import openai

from .config import JudgeConfig
from .parse import BadAnswer, Verdict, parse_answer
from .prompt import answer_regex, answer_schema, answer_tokens, messages

log = logging.getLogger(__name__)

PURPOSE_HEADERS = {"X-Streamrl-Purpose": "judge"}
"""Sent with every judge call: a streamrl gateway records it with purpose ``judge``, never trained on."""


class JudgeFailed(RuntimeError):
    """The judge gave no usable answer in ``max_attempts``; the message has the last reason."""


class Stopped(RuntimeError):
    """The service is stopping: the group is left for the next run."""


@dataclass(frozen=True, slots=True)
class Judged:
    verdict: Verdict
    attempts: int
    prompt_tokens: int
    completion_tokens: int
    """Tokens of every attempt, the refused ones included."""


class JudgeClient:
    def __init__(self, config: JudgeConfig, stop: threading.Event) -> None:
        self.config, self.stop = config, stop
        self.client = openai.OpenAI(base_url=config.base_url,
                                    api_key=config.api_key or os.environ.get("STREAMRL_JUDGE_API_KEY") or "none",
                                    timeout=config.request_timeout_s, max_retries=0)

    def request(self, rubric: str, rendered: list[str]) -> dict:
        """The chat completion's arguments for judging ``rendered`` (without the headers)."""
        c = self.config
        kwargs: dict = {"model": c.model, "messages": messages(rubric, rendered, c.max_score),
                        "temperature": c.temperature}
        if c.structured_output == "vllm":
            kwargs["extra_body"] = {"structured_outputs": {
                "regex": answer_regex(len(rendered), c.max_score, c.max_explanation_chars)}}
        elif c.structured_output == "json_schema":
            schema = answer_schema(len(rendered), c.max_score, c.max_explanation_chars)
            kwargs["response_format"] = {"type": "json_schema",
                                         "json_schema": {"name": "judgement", "strict": True, "schema": schema}}
        if c.max_tokens is not None:
            kwargs["max_tokens"] = (c.max_tokens if c.structured_output == "off" else
                                    min(c.max_tokens, answer_tokens(len(rendered), c.max_score, c.max_explanation_chars)))
        return kwargs

    def judge(self, rubric: str, rendered: list[str], group_id: str) -> Judged:
        c = self.config
        kwargs = self.request(rubric, rendered)
        backoff, attempts, failures = c.retry_backoff_s, 0, 0
        tokens = [0, 0]
        while True:
            if self.stop.is_set():
                raise Stopped(group_id)
            try:
                reply = self.client.chat.completions.create(
                    extra_headers={**PURPOSE_HEADERS, "X-Group-Id": f"judge.{group_id}"}, **kwargs)
            except (openai.APIConnectionError, openai.APITimeoutError, openai.RateLimitError,
                    openai.InternalServerError) as exc:
                log.warning("judge call for group %s failed (%s); retrying in %.1fs", group_id, exc, backoff)
                self.stop.wait(backoff)
                backoff = min(backoff * 2, c.max_backoff_s)
                continue
            except openai.BadRequestError as exc:  # the same request would be refused again: e.g. the context
                raise JudgeFailed(f"group {group_id}: the judge endpoint refused the request: {exc.message}") from None
            attempts += 1
            if reply.usage is not None:
                tokens[0] += reply.usage.prompt_tokens
                tokens[1] += reply.usage.completion_tokens
            text = reply.choices[0].message.content if reply.choices else None
            try:
                verdict = parse_answer(text, len(rendered), c.max_score)
            except BadAnswer as exc:
                failures += 1
                if failures >= c.max_attempts:
                    raise JudgeFailed(f"group {group_id}: no usable judge answer in {attempts} attempts; "
                                      f"last: {exc}") from None
                log.info("judge answer for group %s refused (%s); asking again", group_id, exc)
                self.stop.wait(backoff)
                backoff = min(backoff * 2, c.max_backoff_s)
                continue
            return Judged(verdict, attempts, tokens[0], tokens[1])
