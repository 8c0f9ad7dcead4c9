"""The shop task (examples/shop.py) as a LangGraph ReAct agent: a ``StateGraph`` over ``MessagesState`` whose
model node is LangChain's ``ChatOpenAI`` pointed at the gateway, and LangGraph's prebuilt ``ToolNode`` and
``tools_condition`` for the loop (``langgraph.prebuilt.create_react_agent`` builds the same graph, and is
deprecated since LangGraph 1.0).

Train:    streamrl up --demo --demo-task examples.langgraph_react.agent:ShopGraphTask --model smollm2-135m
Evaluate: python -m streamrl.producers.evaluate examples.langgraph_react.agent:ShopGraphTask --gateway http://127.0.0.1:8080
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Literal

from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.graph.state import CompiledStateGraph
from langgraph.prebuilt import ToolNode, tools_condition

from streamrl.producers.agent import AgentTask
from streamrl.producers.client import AsyncTrajectory

from ..shop import INSTRUCTIONS, ITEMS, Order, held_out_orders, price_answer, sample_order, score


@tool
def price_of(item: Literal[ITEMS]) -> str:  # type: ignore[valid-type]
    """Look up the price of one item, in cents."""
    return price_answer(item)


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two whole numbers."""
    return a * b


TOOLS = [price_of, multiply]


def build_graph(llm: ChatOpenAI, first_tool: str | None = None) -> CompiledStateGraph:
    """The ReAct loop: model -> tools -> model ... until the model answers without a tool call. With
    ``first_tool``, the model's first turn must call that tool (a named ``tool_choice``)."""
    free = llm.bind_tools(TOOLS, strict=True)
    forced = llm.bind_tools(TOOLS, strict=True, tool_choice=first_tool) if first_tool else free

    async def model(state: MessagesState) -> dict:
        called = any(isinstance(m, ToolMessage) for m in state["messages"])
        return {"messages": [await (free if called else forced).ainvoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("model", model)
    graph.add_node("tools", ToolNode(TOOLS))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)
    graph.add_edge("tools", "model")
    return graph.compile()


@dataclass
class ShopGraphTask(AgentTask):
    model: str = "policy"
    temperature: float = 1.0
    max_tokens: int = 128
    max_turns: int = 4
    """Model calls per episode; an episode that runs out of them scores 0."""
    first_tool: str | None = None
    """Make the first model call use this tool (named ``tool_choice``; vLLM enforces it with guided decoding):
    a foothold for a model that does not call tools on its own yet."""
    seed: int | None = None
    """Sampling seed of every call (reproducible episodes)."""
    held_out: list[Order] = field(default_factory=held_out_orders)

    def sample(self, rng: random.Random) -> Order:
        return sample_order(rng)

    async def play(self, t: AsyncTrajectory, problem: Order, *, model: str, temperature: float) -> float:
        llm = ChatOpenAI(model=model, base_url=t.base_url, api_key="unused", default_headers=t.headers,
                         http_async_client=t.http, temperature=temperature, max_tokens=self.max_tokens,
                         seed=self.seed, max_retries=0)
        graph = build_graph(llm, self.first_tool)
        try:
            state = await graph.ainvoke(
                {"messages": [SystemMessage(INSTRUCTIONS), HumanMessage(problem.question)]},
                {"recursion_limit": 2 * self.max_turns})  # a model turn and a tool turn per round
        except GraphRecursionError:
            return 0.0
        messages = state["messages"]
        tool_answers = [m.text for m in messages if isinstance(m, ToolMessage) and m.status == "success"]
        return score(problem, messages[-1].text, tool_answers)
