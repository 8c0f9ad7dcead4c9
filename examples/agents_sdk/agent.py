"""The shop task (examples/shop.py) as an OpenAI Agents SDK agent: function tools, the SDK's own loop
(``Runner.run``), its chat-completions model pointed at the gateway through the trajectory's client.

Train:    streamrl up --demo --demo-task examples.agents_sdk.agent:ShopAgentTask --model smollm2-135m
Evaluate: python -m streamrl.producers.evaluate examples.agents_sdk.agent:ShopAgentTask --gateway http://127.0.0.1:8080
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Literal

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    RunConfig,
    Runner,
    RunResult,
    StopAtTools,
    ToolCallOutputItem,
    function_tool,
    set_tracing_disabled,
)
from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError

from streamrl.producers.agent import AgentTask
from streamrl.producers.client import AsyncTrajectory

from ..shop import INSTRUCTIONS, ITEMS, Order, held_out_orders, price_answer, sample_order, score

set_tracing_disabled(True)  # traces go to OpenAI's servers by default; the gateway's log is the record here

Item = Literal[ITEMS]  # type: ignore[valid-type]  # the schema's enum: the model can only name a real item


@function_tool
def price_of(item: Item) -> str:
    """Look up the price of one item, in cents.

    Args:
        item: The item's name, singular.
    """
    return price_answer(item)


@function_tool
def multiply(a: int, b: int) -> int:
    """Multiply two whole numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a * b


@dataclass
class ShopAgentTask(AgentTask):
    model: str = "policy"
    temperature: float = 1.0
    max_tokens: int = 128
    max_turns: int = 4
    """Model calls per episode (the SDK's ``max_turns``); an episode that runs out of them scores 0."""
    first_tool: str | None = None
    """Make the first call use this tool (a named ``tool_choice``, which vLLM enforces with guided decoding);
    the SDK resets it to ``auto`` after the tool runs (``reset_tool_choice``), so the agent answers freely
    next. A foothold for a model that does not call tools on its own yet."""
    tool_steps: list[str] | None = None
    """A ladder for a model that looks a price up but never multiplies on its own: each call is made to use the
    next of these tools (``["price_of", "multiply"]``), and the last tool's answer is the episode's answer (the
    SDK's ``StopAtTools``, the run continued from ``to_input_list()``). The model still chooses every argument:
    what it learns is to multiply the looked-up price by the asked quantity. Not with ``first_tool``."""
    seed: int | None = None
    """Sampling seed of every call (reproducible episodes)."""
    held_out: list[Order] = field(default_factory=held_out_orders)

    def __post_init__(self) -> None:
        if self.tool_steps is not None:
            tools = {price_of.name, multiply.name}
            if not self.tool_steps or not set(self.tool_steps) <= tools:
                raise ValueError(f"tool_steps must name tools among {sorted(tools)}, not {self.tool_steps!r}")
            if self.first_tool is not None:
                raise ValueError("tool_steps forces every call already: give it or first_tool, not both")

    def sample(self, rng: random.Random) -> Order:
        return sample_order(rng)

    def agent(self, t: AsyncTrajectory, model: str, temperature: float, tool: str | None = None) -> Agent:
        """The shop assistant; with ``tool``, one that must call it and stops once it ran (a step of ``tool_steps``)."""
        return Agent(
            name="shop assistant",
            instructions=INSTRUCTIONS,
            tools=[price_of, multiply],
            model=OpenAIChatCompletionsModel(model=model, openai_client=t.client),  # the trajectory's ids ride along
            model_settings=ModelSettings(temperature=temperature, max_tokens=self.max_tokens,
                                         tool_choice=tool or self.first_tool,
                                         extra_args=None if self.seed is None else {"seed": self.seed}),
            **({"tool_use_behavior": StopAtTools(stop_at_tool_names=[tool])} if tool else {}),
        )

    async def play(self, t: AsyncTrajectory, problem: Order, *, model: str, temperature: float) -> float:
        config = RunConfig(tracing_disabled=True)
        results: list[RunResult] = []
        try:
            if self.tool_steps:
                for tool in self.tool_steps:  # each step goes on from the conversation so far
                    results.append(await Runner.run(self.agent(t, model, temperature, tool),
                                                    results[-1].to_input_list() if results else problem.question,
                                                    max_turns=2, run_config=config))
            else:
                results.append(await Runner.run(self.agent(t, model, temperature), problem.question,
                                                max_turns=self.max_turns, run_config=config))
        except (MaxTurnsExceeded, ModelBehaviorError):  # out of turns, a malformed tool call: the episode failed
            return 0.0
        tool_answers = [str(item.output) for r in results for item in r.new_items if isinstance(item, ToolCallOutputItem)]
        return score(problem, str(results[-1].final_output or ""), tool_answers)
