"""The tic-tac-toe agent: the model plays X against a scripted opponent, one chat turn per move, through the
gateway with the producer SDK (``streamrl.producers``). Every move is a call of the same trajectory, so the
trainer sees the whole game; the reward comes at its end (``game.REWARDS``; an illegal move ends it early).

Train:    streamrl up --demo --demo-task examples.tictactoe.agent:TicTacToeTask --model smollm2-135m
Evaluate: python -m streamrl.producers.evaluate examples.tictactoe.agent:TicTacToeTask --gateway http://127.0.0.1:8080
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from streamrl.producers.agent import AgentTask
from streamrl.producers.client import AsyncTrajectory

from .game import REWARDS, Board, Opponent, illegal_reward, parse_move

SYSTEM = ("You play tic-tac-toe as X. Cells are named by column and row: a1 is top left, c3 bottom right. "
          "Each turn you see the board; reply with the cell you take, e.g. b2.")

HELD_OUT_SEEDS = range(1_000_000, 1_000_064)
"""The held-out games: the opponent's dice and who moves first come from these seeds, never drawn for training."""


@dataclass(frozen=True, slots=True)
class Game:
    seed: int
    agent_first: bool


@dataclass
class TicTacToeTask(AgentTask):
    model: str = "policy"
    temperature: float = 1.0
    max_tokens: int = 16
    strength: float = 0.5
    """The opponent's strength (``game.Opponent``): 0 plays at random, 1 never loses."""
    legal_moves_only: bool = False
    """Sample only legal cells (vLLM's structured outputs, ``choice``): every game is played to its end, even by
    an untrained model; what is learned is which cell. Off, a reply must name a free cell to go on."""
    held_out_games: int = 32
    held_out: list[Game] = field(init=False)

    def __post_init__(self) -> None:
        Opponent(self.strength)  # a ValueError now for a strength out of range
        if not 0 < self.held_out_games <= len(HELD_OUT_SEEDS):
            raise ValueError(f"held_out_games must be in 1..{len(HELD_OUT_SEEDS)}")
        self.held_out = [Game(s, s % 2 == 0) for s in HELD_OUT_SEEDS[:self.held_out_games]]

    def sample(self, rng: random.Random) -> Game:
        return Game(rng.randrange(HELD_OUT_SEEDS.start), rng.random() < 0.5)

    async def play(self, t: AsyncTrajectory, problem: Game, *, model: str, temperature: float) -> float:
        rng = random.Random(problem.seed)
        opponent = Opponent(self.strength)
        board = Board()
        if not problem.agent_first:
            board.play(opponent.move(board, rng), "O")
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
        moves = 0
        while True:
            messages.append({"role": "user", "content": f"{board.render()}\nYour move."})
            extra = {"structured_outputs": {"choice": board.legal()}} if self.legal_moves_only else None
            reply = await t.client.chat.completions.create(model=model, messages=messages, max_tokens=self.max_tokens,
                                                           temperature=temperature, extra_body=extra)
            text = reply.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": text})
            move = parse_move(text)
            if move is None or move not in board.legal():
                return illegal_reward(moves)
            board.play(move, "X")
            moves += 1
            if board.winner() is None:
                board.play(opponent.move(board, rng), "O")
            if (result := board.winner()) is not None:
                return REWARDS[result]
