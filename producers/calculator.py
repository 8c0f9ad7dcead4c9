"""A multi-turn tool-using agent: arithmetic with a calculator tool, meant for real models.

Each problem is "what is a op b?". The agent may call the ``calculator`` tool (OpenAI tool calls; the
gateway passes ``tools`` through to vLLM's tool parser), gets the result back as a ``tool`` message, and
ends with a plain answer. Reward: 1.0 when the last number in the final answer is right; otherwise 0.1
if the agent made at least one well-formed calculator call (a foothold for small models), else 0.

Every turn is a separate chat call tagged with the same trajectory id, so the trainer sees the whole
episode and trains only the tokens the model sampled (tool results come from the environment).
"""

from __future__ import annotations

import ast
import json
import operator
import random
from dataclasses import dataclass
from typing import Any

from .client import AsyncGateway
from .episode import Outcome, completion_tokens, final_number, newest, served_version

TOOLS: list[dict[str, Any]] = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with + - * / // % and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (12 + 7) * 3"}},
            "required": ["expression"],
        },
    },
}]

SYSTEM = ("You solve arithmetic problems. Use the calculator tool for the computation, then reply with "
          "the final number only.")

_OPS: dict[type, Any] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.USub: operator.neg, ast.UAdd: operator.pos,
}


def calculate(expression: str) -> float:
    """Evaluate plain arithmetic without ``eval``: numbers, + - * / // %, unary signs, parentheses.
    Raises ValueError for anything else (names, calls, powers, very long input)."""
    if len(expression) > 200:
        raise ValueError("expression too long")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from exc

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"unsupported: {ast.dump(node)[:60]}")

    try:
        return ev(tree)
    except ZeroDivisionError as exc:
        raise ValueError("division by zero") from exc


def format_number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.6g}"


def score(answer_text: str, expected: float, used_tool: bool) -> float:
    got = final_number(answer_text)
    if got is not None and abs(got - expected) < 1e-6:
        return 1.0
    return 0.1 if used_tool else 0.0


def run_tool(name: str, arguments: str) -> tuple[str, bool]:
    """The tool message content for one call, and whether the call was well formed."""
    if name != "calculator":
        return f"error: unknown tool {name!r}", False
    try:
        args = json.loads(arguments or "{}")
        return format_number(calculate(str(args["expression"]))), True
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: {exc}", False


@dataclass(frozen=True, slots=True)
class Problem:
    question: str
    answer: float


@dataclass(frozen=True, slots=True)
class CalculatorTask:
    model: str = "policy"
    max_turns: int = 4
    max_tokens: int = 96
    temperature: float = 1.0
    force_tool_first: bool = False
    """Force a calculator call on the first turn (vLLM's named tool choice, guided decoding), so that even
    an untrained model goes through the whole tool loop."""
    seed: int | None = None
    """Sampling seed of the episode's first request (the next turns use seed + turn): reproducible episodes."""

    def sample(self, rng: random.Random) -> Problem:
        a, b = rng.randint(2, 999), rng.randint(2, 99)
        op = rng.choice("+-*")
        return Problem(f"What is {a} {op} {b}?", calculate(f"{a} {op} {b}"))

    async def episode(self, gateway: AsyncGateway, problem: Problem, group_id: str, group_size: int) -> Outcome:
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                          {"role": "user", "content": problem.question}]
        version: int | None = None
        used_tool = False
        answer = ""
        turns = 0
        sampled: list[int | None] = []
        async with gateway.trajectory(group_id=group_id, group_size=group_size) as t:
            for turns in range(1, self.max_turns + 1):
                forced = self.force_tool_first and turns == 1
                raw = await t.client.chat.completions.with_raw_response.create(
                    model=self.model, messages=messages, tools=TOOLS,
                    tool_choice={"type": "function", "function": {"name": "calculator"}} if forced else "auto",
                    max_tokens=self.max_tokens, temperature=self.temperature,
                    seed=None if self.seed is None else self.seed + turns - 1)
                version = newest(version, served_version(raw.headers))
                reply = raw.parse()
                sampled.append(completion_tokens(reply))
                message = reply.choices[0].message
                if not message.tool_calls:
                    answer = message.content or ""
                    break
                messages.append({"role": "assistant", "content": message.content or "",
                                 "tool_calls": [c.model_dump() for c in message.tool_calls]})
                for call in message.tool_calls:
                    content, ok = run_tool(call.function.name, call.function.arguments)
                    used_tool = used_tool or ok
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
            reward = score(answer, problem.answer, used_tool)
            t.reward(reward, turns=turns)
        reply_tokens = None if None in sampled else sum(n for n in sampled if n is not None)
        return Outcome(reward, version, t.trajectory_id, turns, reply_tokens)
