"""The shop task the tool-agent examples share (agents_sdk, langgraph_react, mcp_tools): "what do 7 plums
cost?", answered by looking a price up with a tool and multiplying. The catalogue is generated from a seed,
so the model cannot know a price without asking; the answer is exact.

Reward, rungs a small model climbs one at a time (``score``): 1.0 for the exact total as the reply's last
number; else 0.6 when a tool answered with the total (``multiply`` called with the quantity and the price); 0.3
when a tool answered with the asked item's price (the right item looked up); 0.1 when a tool answered at all;
else 0. SmolLM2-135M with its first call forced to ``price_of`` looks up the asked item in about half its
episodes and never multiplies: with the total alone rewarded, every one of its groups scored 0.1 and nothing
was learned (docs/benchmarks.md, ``shop-agent``).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from streamrl.producers.episode import final_number

ITEMS = ("apple", "pear", "plum", "peach", "lemon", "mango", "melon", "kiwi", "grape", "cherry", "onion", "potato",
         "carrot", "tomato", "pepper", "garlic", "leek", "bean", "radish", "turnip")
QUANTITIES = range(2, 13)
HELD_OUT = 32

INSTRUCTIONS = ("You are a shop assistant. Prices are in cents and you do not know them: look each one up with "
                "price_of, then compute the total. End with the total in cents, as a number.")


def catalogue(seed: int = 0) -> dict[str, int]:
    """Each item's price in cents, fixed by ``seed``."""
    rng = random.Random(seed)
    return {item: rng.randrange(15, 400) for item in ITEMS}


PRICES = catalogue()


@dataclass(frozen=True, slots=True)
class Order:
    item: str
    quantity: int

    @property
    def question(self) -> str:
        return f"How much do {self.quantity} {self.item}s cost, in cents?"

    def total(self, prices: dict[str, int] = PRICES) -> int:
        return self.quantity * prices[self.item]


def _all_orders() -> list[Order]:
    return [Order(item, q) for item in ITEMS for q in QUANTITIES]


def held_out_orders() -> list[Order]:
    """A fixed set of orders, never sampled for training."""
    return random.Random(1234).sample(_all_orders(), HELD_OUT)


_TRAIN = sorted(set(_all_orders()) - set(held_out_orders()), key=lambda o: (o.item, o.quantity))


def sample_order(rng: random.Random) -> Order:
    return rng.choice(_TRAIN)


def price_answer(item: str, prices: dict[str, int] = PRICES) -> str:
    """What the price_of tool answers (an unknown item gets a message, not an exception: the agent reads it)."""
    if item not in prices:
        return f"unknown item {item!r}; the shop sells {', '.join(sorted(prices))}"
    return f"one {item} costs {prices[item]} cents"


def score(order: Order, answer: str, tool_answers: Sequence[str], prices: dict[str, int] = PRICES) -> float:
    """``answer``: the agent's final reply; ``tool_answers``: what its tools answered (only calls that ran)."""
    got = final_number(answer)
    total = order.total(prices)
    if got is not None and got == total:
        return 1.0
    answers = {a.strip().lower() for a in tool_answers}
    if str(total) in answers:
        return 0.6
    if price_answer(order.item, prices) in answers:
        return 0.3
    return 0.1 if answers else 0.0
