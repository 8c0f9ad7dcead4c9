"""Tic-tac-toe rules and a scripted opponent of adjustable strength: the environment, without a model.

Cells are named a1..c3 (column letter, row digit). The agent plays X; the opponent plays O and, with
probability ``strength``, the best move (win, else block, else centre, corner, side), else a random legal one.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

CELLS = tuple(f"{col}{row}" for row in "123" for col in "abc")
LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))
_MOVE = re.compile(r"\b([abc])\s*([123])\b", re.IGNORECASE)
_PREFERENCE = (4, 0, 2, 6, 8, 1, 3, 5, 7)  # centre, corners, sides


@dataclass
class Board:
    cells: list[str] = field(default_factory=lambda: [" "] * 9)

    def legal(self) -> list[str]:
        return [CELLS[i] for i, c in enumerate(self.cells) if c == " "]

    def play(self, cell: str, mark: str) -> None:
        """Put ``mark`` on ``cell``; a ValueError for a cell that does not exist or is taken."""
        if cell not in CELLS:
            raise ValueError(f"no cell {cell!r}: cells are a1..c3")
        i = CELLS.index(cell)
        if self.cells[i] != " ":
            raise ValueError(f"{cell} is taken")
        self.cells[i] = mark

    def winner(self) -> str | None:
        """X or O when a line is complete, "draw" when the board is full, else None."""
        for a, b, c in LINES:
            if self.cells[a] != " " and self.cells[a] == self.cells[b] == self.cells[c]:
                return self.cells[a]
        return "draw" if " " not in self.cells else None

    def render(self) -> str:
        rows = [f"{r} " + " ".join(self.cells[3 * (int(r) - 1) + i].replace(" ", ".") for i in range(3)) for r in "123"]
        return "  a b c\n" + "\n".join(rows)


def parse_move(text: str) -> str | None:
    """The last cell named in a reply ("I play b2." -> "b2"), or None."""
    found = _MOVE.findall(text)
    return f"{found[-1][0].lower()}{found[-1][1]}" if found else None


def best_move(board: Board, mark: str) -> str:
    """Win if possible, else block the other side's win, else the first free cell of centre, corners, sides."""
    other = "O" if mark == "X" else "X"
    for who in (mark, other):
        for line in LINES:
            marks = [board.cells[i] for i in line]
            if marks.count(who) == 2 and marks.count(" ") == 1:
                return CELLS[line[marks.index(" ")]]
    return next(CELLS[i] for i in _PREFERENCE if board.cells[i] == " ")


@dataclass(frozen=True, slots=True)
class Opponent:
    strength: float = 0.5
    """Probability of the best move at each turn (0: random, 1: never loses)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.strength <= 1.0:
            raise ValueError(f"opponent strength must be in [0, 1], not {self.strength}")

    def move(self, board: Board, rng: random.Random) -> str:
        return best_move(board, "O") if rng.random() < self.strength else rng.choice(board.legal())


REWARDS = {"X": 1.0, "draw": 0.5, "O": 0.0}
"""The agent's reward by the game's end: a win, a draw, a loss."""
ILLEGAL = -1.0
ILLEGAL_CREDIT = 0.2
"""An unreadable or illegal move ends the game at ``ILLEGAL``, plus this much per legal move made before it:
a small model learns to keep playing legal moves before it learns to win."""


def illegal_reward(legal_moves: int) -> float:
    return ILLEGAL + ILLEGAL_CREDIT * legal_moves
