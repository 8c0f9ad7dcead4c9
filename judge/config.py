"""The judge service's typed configuration: defaults here, then a TOML/JSON file, then command-line flags."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from streamrl.broker.security import KafkaSettings
from streamrl.config_file import load_config

DEFAULT_RUBRIC = ("Score how well each trajectory accomplishes the task the user set, relative to the others: "
                  "a correct, complete answer scores high; a wrong, incomplete or off-topic one low.")


@dataclass
class JudgeConfig:
    """Every knob of ``streamrl judge``."""

    base_url: str = "http://127.0.0.1:8080/v1"
    """OpenAI-compatible base URL of the judge model (with ``/v1``): the gateway, a separate vLLM, a hosted API.
    Calls carry ``X-Streamrl-Purpose: judge``, so a gateway records them as never to be trained on."""
    model: str = ""
    """The judge model's name at ``base_url`` (required)."""
    api_key: str = ""
    """API key for ``base_url``; empty: the environment variable STREAMRL_JUDGE_API_KEY, else none."""
    kafka: KafkaSettings = field(default_factory=KafkaSettings)
    """The Kafka of the judge's consumer and producer: brokers, topic prefix, security."""
    name: str = "judge"
    """This judge's id: stamped on its rewards as ``judged_by``; its consumer group is streamrl-judge.<name>."""
    rubric: str = DEFAULT_RUBRIC
    """The rubric of judge requests that give none and whose group matches no ``group_rubrics`` prefix."""
    group_rubrics: dict[str, str] = field(default_factory=dict)
    """Group-id prefix -> rubric, for requests that give none (the longest matching prefix wins)."""
    weight: float = 0.5
    """Default weight of the judge's score when a request carries the producer's own reward:
    reward = weight * judge + (1 - weight) * agent."""
    quiet_period_s: float = 5.0
    """A group whose requests say no ``group_size`` is complete when none of its records came for this long
    (its completions too: a straggling call postpones it)."""
    settle_s: float = 1.0
    """A group complete by ``group_size`` is judged once none of its records came for this long: a
    trajectory's last call may reach the log after its judge request."""
    max_score: int = 10
    """The judge scores each trajectory with an integer in [0, max_score]; the reward is score / max_score."""
    max_explanation_chars: int = 600
    """The longest explanation asked of the judge (structured output bounds it)."""
    max_tokens: int | None = None
    """Most tokens one judge answer may take. None (the default): none is asked, so the server leaves the
    answer whatever the prompt leaves of the judge model's context, and structured output ends the answer
    where its shape does; any fixed figure either wastes context or overflows it for some group (a group of
    16 on a 2,048 context: a 1,251-token prompt and the 798 tokens the longest admissible answer could
    take). Set, it is capped by ``prompt.answer_tokens`` (the longest answer of that shape)."""
    temperature: float = 0.0
    structured_output: Literal["vllm", "json_schema", "off"] = "vllm"
    """How the answer's shape is asked for. ``vllm``: vLLM's ``structured_outputs`` with a regular expression
    of the exact answer (its JSON-schema grammar lets a weak model pad whitespace until ``max_tokens``);
    ``json_schema``: the OpenAI ``response_format`` (hosted APIs); ``off``: the prompt only."""
    max_attempts: int = 3
    """Judge answers that fail the strict parser are asked again this many times in all, then the group is
    counted ``judge_failures`` and left unrewarded."""
    retry_backoff_s: float = 0.5
    """First pause before asking again; it doubles on each retry (network errors retry without limit, at
    most ``max_backoff_s`` apart)."""
    max_backoff_s: float = 30.0
    request_timeout_s: float = 300.0
    concurrency: int = 4
    """Groups judged at once."""
    max_chars_per_trajectory: int = 6000
    """A rendered trajectory longer than this keeps its start and end around an elision mark."""
    trajectory_ttl_s: float = 600.0
    """Completions without a judge request (trajectories rewarded by their producer) are forgotten after this."""
    max_trajectories: int = 50_000
    """Bound on trajectories held; the oldest are forgotten beyond it (counted ``evicted``)."""
    commit_interval_s: float = 1.0
    """Offsets are committed this often, only up to records whose rewards are acknowledged. A restart re-reads
    what came after the last commit and skips the trajectories it finds its own rewards for, so a longer
    interval costs re-reading, never a duplicate."""
    poll_timeout_s: float = 0.2

    def __post_init__(self) -> None:
        self.kafka = KafkaSettings.of(self.kafka)
        self.group_rubrics = dict(self.group_rubrics)
        if not 0.0 <= self.weight <= 1.0:
            raise ValueError("weight must be in [0, 1]")
        if self.max_score < 1 or self.max_attempts < 1 or self.concurrency < 1:
            raise ValueError("max_score, max_attempts and concurrency must be >= 1")
        if self.structured_output not in ("vllm", "json_schema", "off"):
            raise ValueError(f"structured_output must be vllm, json_schema or off, not {self.structured_output!r}")
        if self.quiet_period_s < 0:
            raise ValueError("quiet_period_s must be >= 0")

    @property
    def consumer_group(self) -> str:
        return f"streamrl-judge.{self.name}"

    def rubric_for(self, group_id: str) -> str:
        match = max((p for p in self.group_rubrics if group_id.startswith(p)), key=len, default=None)
        return self.rubric if match is None else self.group_rubrics[match]

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> JudgeConfig:
        """Defaults, then the file (a ``[judge]`` table if present), then the overrides not None."""
        return load_config(cls, path, "judge", overrides)

    def describe(self) -> str:
        values = {**dataclasses.asdict(self), "kafka": self.kafka.redacted(), "api_key": "***" if self.api_key else ""}
        return "\n".join(f"  {k} = {v!r}" for k, v in values.items())
