"""The demo task: "write numbers". Reward = the fraction of the reply's visible characters that are digits.

Chosen so that the tiny random model of the demo and the tests can learn it within minutes: a random
policy already writes some numbers (about a third of the tiny tokenizer's vocabulary is number tokens,
so the starting reward is low but not zero and varies within a group, which is what GRPO needs), and
pushing probability towards number tokens is a direction LoRA can move quickly. Real models learn it in
a handful of steps, so it also works as a smoke test of a deployment.

``context_words`` puts the same long system message ahead of every prompt, as an agent's instructions
and tool descriptions are: vLLM's prefix cache serves it almost for free, while the trainer processes
it with every sample. It is how the loop benchmark sets the share of training in a step.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .client import AsyncGateway
from .episode import Outcome, completion_tokens, served_version

PROMPTS = (
    "Write some numbers.",
    "List a few numbers please.",
    "Count with me.",
    "Give me digits only.",
    "What is the sum of two numbers?",
    "Reply with numbers.",
    "Tell me a number.",
    "Numbers, please.",
)

_MANUAL_WORDS = (
    "the", "agent", "reads", "each", "request", "carefully", "and", "answers", "with", "the", "tool",
    "that", "fits", "it", "best", "when", "a", "tool", "returns", "an", "error", "the", "agent", "explains",
    "what", "went", "wrong", "and", "tries", "a", "different", "approach", "every", "answer", "should",
    "be", "short", "and", "exact", "and", "should", "follow", "the", "format", "that", "the", "user",
    "asked", "for",
)


def context_text(words: int) -> str:
    """A deterministic system message of ``words`` words (the same text for every call, so that it is
    one shared prefix for vLLM's cache)."""
    return " ".join(_MANUAL_WORDS[i % len(_MANUAL_WORDS)] for i in range(words))


def digit_fraction(text: str) -> float:
    """Digits / non-whitespace characters of ``text``; 0.0 for a reply with nothing visible."""
    visible = [c for c in text if not c.isspace()]
    if not visible:
        return 0.0
    return sum(c.isdigit() for c in visible) / len(visible)


@dataclass(frozen=True, slots=True)
class NumbersTask:
    """Sampling settings of the task. temperature 1.0: the behaviour policy is the model's own
    distribution, which is what the trainer's importance ratios compare against."""

    model: str = "policy"
    max_tokens: int = 16
    temperature: float = 1.0
    context_words: int = 0
    """Words of shared system message ahead of each prompt (0: none)."""

    def sample(self, rng: random.Random) -> str:
        return rng.choice(PROMPTS)

    def messages(self, prompt: str) -> list[dict[str, str]]:
        """The chat messages of one call: the shared context (if any), then the prompt."""
        context = [{"role": "system", "content": context_text(self.context_words)}] if self.context_words else []
        return [*context, {"role": "user", "content": prompt}]

    def demonstration(self, prompt: str) -> list[dict[str, str]]:
        """An exchange of reward 1 (nothing but digits), as chat messages: SFT warm-up data."""
        return [*self.messages(prompt), {"role": "assistant", "content": "4 8 1 5 9 2 6 3"}]

    async def episode(self, gateway: AsyncGateway, prompt: str, group_id: str, group_size: int) -> Outcome:
        """One trajectory: one chat call, reward posted when the trajectory closes."""
        async with gateway.trajectory(group_id=group_id, group_size=group_size) as t:
            raw = await t.client.chat.completions.with_raw_response.create(
                model=self.model, messages=self.messages(prompt),  # type: ignore[arg-type]
                max_tokens=self.max_tokens, temperature=self.temperature)
            reply = raw.parse()
            reward = digit_fraction(reply.choices[0].message.content or "")
            t.reward(reward)
        return Outcome(reward, served_version(raw.headers), t.trajectory_id,
                       reply_tokens=completion_tokens(reply))
