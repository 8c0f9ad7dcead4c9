"""The shop task (examples/shop.py) with tools that live in an MCP server: each episode starts the server
(server.py, over stdio, with the official ``mcp`` SDK's client), discovers its tools (``list_tools``), offers
them to the model as OpenAI tools through the gateway, and runs the calls the model makes on the server.

Train:    streamrl up --demo --demo-task examples.mcp_tools.agent:McpShopTask --model smollm2-135m
Evaluate: python -m streamrl.producers.evaluate examples.mcp_tools.agent:McpShopTask --gateway http://127.0.0.1:8080
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mcp import Client, StdioServerParameters
from mcp.client.stdio import get_default_environment
from mcp.types import TextContent, Tool

from streamrl.producers.agent import AgentTask
from streamrl.producers.client import AsyncTrajectory

from ..shop import INSTRUCTIONS, PRICES, Order, held_out_orders, sample_order, score

SYSTEM = INSTRUCTIONS.replace("price_of", "the shop's tools")
REPO = Path(__file__).resolve().parents[2]


def openai_tool(tool: Tool) -> dict[str, Any]:
    """An MCP tool as an OpenAI chat-completions tool: the same JSON Schema for its arguments, ``strict`` so that
    a server that enforces it (vLLM: guided decoding) samples only arguments the tool takes."""
    return {"type": "function", "function": {"name": tool.name, "description": tool.description or "",
                                             "parameters": tool.input_schema, "strict": True}}


def tool_text(content: list[Any]) -> str:
    return "\n".join(c.text for c in content if isinstance(c, TextContent))


def write_database(path: Path, prices: dict[str, int] = PRICES) -> Path:
    """The shop's products table (name, price in cents, units in stock), written once; the server reads it."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)
        with sqlite3.connect(tmp) as db:
            db.execute("CREATE TABLE products (name TEXT PRIMARY KEY, price_cents INTEGER, stock INTEGER)")
            db.executemany("INSERT INTO products VALUES (?, ?, ?)",
                           [(name, price, (price * 7) % 50) for name, price in prices.items()])
        tmp.replace(path)  # whole or absent: episodes start servers on it concurrently
    return path


def default_database() -> Path:
    return Path(os.environ.get("STREAMRL_CACHE", Path.home() / ".cache" / "streamrl")) / "examples" / "shop.sqlite"


@dataclass
class McpShopTask(AgentTask):
    model: str = "policy"
    temperature: float = 1.0
    max_tokens: int = 128
    max_turns: int = 4
    first_tool: str | None = None
    """Make the first call use this tool (named ``tool_choice``, enforced by vLLM's guided decoding): a
    foothold for a model that does not call tools on its own yet."""
    seed: int | None = None
    """Sampling seed of the first call (the next turns use seed + turn): reproducible episodes."""
    database: Path = field(default_factory=default_database)
    held_out: list[Order] = field(default_factory=held_out_orders)

    def __post_init__(self) -> None:
        write_database(self.database)

    def sample(self, rng: random.Random) -> Order:
        return sample_order(rng)

    def server(self) -> StdioServerParameters:
        """The tool server: this interpreter with this process's import path. The MCP SDK hands a server only a
        few safe variables of the environment (no PYTHONPATH), so where packages come from PYTHONPATH rather than
        site-packages the server could not import ``mcp`` and every episode failed."""
        env = {**get_default_environment(), "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        return StdioServerParameters(command=sys.executable, args=["-m", "examples.mcp_tools.server", str(self.database)],
                                     cwd=str(REPO), env=env)

    async def play(self, t: AsyncTrajectory, problem: Order, *, model: str, temperature: float) -> float:
        async with Client(self.server()) as mcp:
            tools = [openai_tool(tool) for tool in (await mcp.list_tools()).tools]
            messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                              {"role": "user", "content": problem.question}]
            tool_answers: list[str] = []
            for turn in range(self.max_turns):
                forced = self.first_tool is not None and turn == 0
                reply = await t.client.chat.completions.create(
                    model=model, messages=messages, tools=tools, max_tokens=self.max_tokens, temperature=temperature,
                    tool_choice={"type": "function", "function": {"name": self.first_tool}} if forced else "auto",
                    seed=None if self.seed is None else self.seed + turn)
                message = reply.choices[0].message
                if not message.tool_calls:
                    return score(problem, message.content or "", tool_answers)
                messages.append(message.model_dump(include={"role", "content", "tool_calls"}))
                for call in message.tool_calls:
                    try:
                        arguments = json.loads(call.function.arguments or "{}")
                        result = await mcp.call_tool(call.function.name, arguments)
                        text, ok = tool_text(result.content), not result.is_error
                    except ValueError as exc:  # arguments that are not JSON
                        text, ok = f"error: {exc}", False
                    if ok:
                        tool_answers.append(text)
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": text})
        return 0.0
