"""The examples' environments without a model: game rules and opponent, the shop's answers, the mailbox and
its answer check, the generated inputs' parsing, and how a user's agent task is named (``module:attr``)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from examples.autotask.agent import parse_inputs
from examples.email_search.mailbox import Inbox, answer_matches, generate, write_index
from examples.shop import PRICES, Order, held_out_orders, price_answer, sample_order, score
from examples.tictactoe.agent import HELD_OUT_SEEDS, TicTacToeTask
from examples.tictactoe.game import Board, Opponent, best_move, illegal_reward, parse_move
from streamrl.producers.demo_cli import DemoConfig, load_task


def test_board_rules() -> None:
    b = Board()
    for cell, mark in (("a1", "X"), ("b2", "O"), ("b1", "X"), ("c3", "O")):
        b.play(cell, mark)
    assert b.winner() is None and "b1" not in b.legal()
    with pytest.raises(ValueError, match="taken"):
        b.play("b2", "X")
    with pytest.raises(ValueError, match="no cell"):
        b.play("d4", "X")
    assert best_move(b, "X") == "c1"  # win on the top row
    b.play("c1", "X")
    assert b.winner() == "X"
    full = Board(list("XOXXOOOXX"))
    assert full.winner() == "draw"


def test_opponent_blocks_at_full_strength_and_strength_is_checked() -> None:
    b = Board()
    b.play("a1", "X")
    b.play("a2", "X")
    assert Opponent(1.0).move(b, random.Random(0)) == "a3"
    with pytest.raises(ValueError, match="strength"):
        Opponent(1.5)


def test_moves_are_parsed_from_replies() -> None:
    assert parse_move("I think B 2, no: c3.") == "c3"
    assert parse_move("center") is None and parse_move("a4") is None
    assert illegal_reward(0) == -1.0 and illegal_reward(4) == pytest.approx(-0.2)


def test_held_out_games_are_never_sampled() -> None:
    task = TicTacToeTask()
    rng = random.Random(0)
    assert all(task.sample(rng).seed < HELD_OUT_SEEDS.start for _ in range(1000))
    assert len(task.held_out) == 32
    with pytest.raises(ValueError, match="held_out_games"):
        TicTacToeTask(held_out_games=0)


def test_shop_orders_and_score() -> None:
    held = set(held_out_orders())
    rng = random.Random(0)
    assert not any(sample_order(rng) in held for _ in range(2000))
    order = Order("plum", 3)
    plum, pear = price_answer("plum"), price_answer("pear")
    assert score(order, f"That is {3 * PRICES['plum']} cents.", []) == 1.0
    assert score(order, "no idea", [plum, str(3 * PRICES["plum"])]) == 0.6, "multiplied right, did not say it"
    assert score(order, f"{PRICES['plum']} cents", [plum]) == 0.3, "the right item looked up"
    assert score(order, "no idea", [pear]) == 0.1 and score(order, "5", []) == 0.0
    assert score(order, f"{3 * PRICES['plum']}", [pear]) == 1.0, "the total is what counts"


def test_mailbox_questions_have_one_answer_in_their_email(tmp_path: Path) -> None:
    emails, questions = generate(600, seed=1)
    assert len(emails) == 600 and len(questions) > 100
    assert len({q.question for q in questions}) == len(questions)
    inbox = Inbox(write_index(tmp_path / "m.sqlite", emails))
    for q in questions[:20]:
        email = inbox.read(q.email_id)
        assert email is not None and q.answer in email.body
    assert inbox.search("") == [] and inbox.search('"; DROP TABLE emails') == []  # words only
    flight = next(q for q in questions if q.question.startswith("What is the confirmation code"))
    city = flight.question.split(" to ")[1].split(" on ")[0]
    assert flight.email_id in {hit["id"] for hit in inbox.search(f"{city} {flight.answer}")}
    with pytest.raises(ValueError):
        generate(0)


def test_answer_check_is_exact_but_forgiving_of_case() -> None:
    assert answer_matches("The code is ab12cd.", "AB12CD")
    assert not answer_matches("AB12CDE", "AB12CD") and not answer_matches("", "4")


def test_generated_inputs_are_parsed() -> None:
    assert parse_inputs("1. red shoes\n- red shoes\n\n* a hat\n2) gloves", 2) == ["red shoes", "a hat"]
    assert parse_inputs(f"{'x' * 501}\nshort", 2) == ["short"], "a runaway line is dropped"


def test_an_agent_task_is_named_module_attr() -> None:
    task = load_task("examples.tictactoe.agent:TicTacToeTask", model="m", temperature=0.5)
    assert isinstance(task, TicTacToeTask) and task.model == "m" and task.temperature == 0.5
    assert DemoConfig(task="examples.tictactoe.agent:TicTacToeTask").task.endswith("TicTacToeTask")
    with pytest.raises(ValueError, match="no module"):
        DemoConfig(task="examples.nothing:Task")
    with pytest.raises(ValueError, match="module:attr"):
        DemoConfig(task="tic tac toe")
    with pytest.raises(ValueError, match="has no"):
        load_task("examples.tictactoe.agent:Nope")
    with pytest.raises(ValueError, match="is not a task"):
        load_task("examples.tictactoe.game:Board")


def test_an_agent_task_takes_its_own_options() -> None:
    """``task_options`` (the demo's, a preset's, ``evaluate --task-options``) reach the task's class by name; one
    it does not take, or options for a built-in task, are clear errors."""
    task = DemoConfig(task="examples.tictactoe.agent:TicTacToeTask", task_options={"max_tokens": 24},
                      model="m").make_task()
    assert isinstance(task, TicTacToeTask) and task.max_tokens == 24 and task.model == "m"
    with pytest.raises(ValueError, match="takes no option 'first_toool'"):
        load_task("examples.tictactoe.agent:TicTacToeTask", {"first_toool": "x"})
    with pytest.raises(ValueError, match="agent tasks"):
        DemoConfig(task="arithmetic", task_options={"max_tokens": 24})


def test_the_mcp_server_imports_nothing_of_streamrl() -> None:
    """The agent starts its MCP server with ``python -m examples.mcp_tools.server`` from the repository's root,
    where the ``streamrl/`` folder stands in front of an installed (not editable) streamrl, as on the GPU
    machines' layout: a server importing streamrl there would fail at its first import."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    code = ("import sys, examples.mcp_tools.server; "
            "sys.exit(','.join(m for m in sys.modules if m == 'streamrl' or m.startswith('streamrl.')) or None)")
    done = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"the server imported {done.stderr.strip() or done.stdout}"


def test_the_mcp_server_gets_this_processs_import_path(tmp_path: Path) -> None:
    """The MCP SDK gives a stdio server only a few safe environment variables; where packages come from
    PYTHONPATH (the GPU machines' layout: ``install.sh --target``) a server without this process's path could not
    import ``mcp``, and every episode failed (seen on an H100: 31,984 of 31,984)."""
    import os

    import mcp

    from examples.mcp_tools.agent import McpShopTask

    params = McpShopTask(database=tmp_path / "shop.sqlite").server()
    assert params.env is not None and "PATH" in params.env
    assert str(Path(mcp.__file__).resolve().parents[1]) in {
        str(Path(p).resolve()) for p in params.env["PYTHONPATH"].split(os.pathsep)}


def test_the_shop_agents_tool_steps_name_its_tools_and_exclude_first_tool() -> None:
    from examples.agents_sdk.agent import ShopAgentTask

    assert ShopAgentTask(tool_steps=["price_of", "multiply"]).tool_steps == ["price_of", "multiply"]
    with pytest.raises(ValueError, match="tools among"):
        ShopAgentTask(tool_steps=["price_of", "divide"])
    with pytest.raises(ValueError, match="tools among"):
        ShopAgentTask(tool_steps=[])
    with pytest.raises(ValueError, match="not both"):
        ShopAgentTask(tool_steps=["price_of", "multiply"], first_tool="price_of")
