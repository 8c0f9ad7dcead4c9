"""`streamrl demo`: run an example environment against a running gateway and print the reward per version.

Groups of ``--group-size`` trajectories (one problem each) are kept in flight; every trajectory is booked
under the policy version that served it, and a line is printed each time a version is superseded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import importlib.util
import inspect
import json
import logging
import os
import re
import sys
import threading
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from streamrl.config_flags import add_config_flags, given

if TYPE_CHECKING:  # the tasks and the runner import the OpenAI client: loaded when the demo runs, not
    # whenever its configuration is read (``streamrl up`` reads it at every start, mistakes included)
    from .runner import Board, Pacer, RunLimits, Task

TASKS = ("numbers", "calculator", "arithmetic")
_SPEC = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def check_task_spec(spec: str) -> None:
    """A ``module:attr`` task (an agent of the user's, e.g. ``examples.tictactoe.agent:TicTacToeTask``) that
    names a module found from the current directory or the installed packages; a ValueError that says what is
    wrong otherwise. The module is only located here, not imported: its framework loads when the demo runs."""
    if not _SPEC.match(spec):
        raise ValueError(f"demo task must be one of {', '.join(TASKS)}, or module:attr naming an agent task "
                         f"(e.g. examples.tictactoe.agent:TicTacToeTask), not {spec!r}")
    module = spec.split(":", 1)[0]
    _importable_from_here()
    try:
        found = importlib.util.find_spec(module)
    except ImportError as exc:  # a parent package that is missing or fails to import
        raise ValueError(f"demo task {spec!r}: cannot import {module}: {exc}") from None
    if found is None:
        raise ValueError(f"demo task {spec!r}: no module {module} (run from the directory that holds it, "
                         f"or install it)")


def _importable_from_here() -> None:
    """Modules of the current directory importable (as ``python -m`` and uvicorn make them): a console script
    has only its own directory on ``sys.path``."""
    here = os.getcwd()
    if here not in sys.path:
        sys.path.insert(0, here)


def load_task(spec: str, options: Mapping[str, Any] | None = None, **settings: Any) -> Task:
    """The task a ``module:attr`` spec names: ``attr`` itself, or, when it is a class or a function, what it
    returns called with those of ``settings`` (model, temperature) its signature takes and every one of
    ``options`` (the task's own settings, e.g. ``first_tool``: one it does not take is a ValueError)."""
    check_task_spec(spec)
    module, attr = spec.split(":", 1)
    target: Any = importlib.import_module(module)
    for part in attr.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ValueError(f"demo task {spec!r}: {module} has no {attr}") from None
    if isinstance(target, type) or (callable(target) and not hasattr(target, "episode")):
        params = inspect.signature(target).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        unknown = sorted(k for k in (options or {}) if k not in params and not takes_any)
        if unknown:
            raise ValueError(f"demo task {spec!r} takes no option {', '.join(map(repr, unknown))} (it takes: "
                             f"{', '.join(params) or 'none'})")
        try:
            target = target(**{k: v for k, v in settings.items() if k in params}, **dict(options or {}))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"demo task {spec!r} with options {dict(options or {})}: {exc}") from None
    elif options:
        raise ValueError(f"demo task {spec!r} is an object, not a class or function: it takes no options")
    if not (callable(getattr(target, "sample", None)) and callable(getattr(target, "episode", None))):
        raise ValueError(f"demo task {spec!r} is not a task: it needs sample(rng) and async episode(gateway, problem, "
                         f"group_id, group_size) (streamrl.producers.agent.AgentTask has them)")
    return target


@dataclass
class DemoConfig:
    """The demo producer's settings (also the ``[demo]`` table of ``streamrl up``'s config file)."""

    task: str = "numbers"
    """numbers, calculator or arithmetic; or ``module:attr``, an agent task of your own (a ``Task`` such as an
    ``agent.AgentTask``, or a class or function returning one), imported from the current directory."""
    task_options: dict[str, Any] = field(default_factory=dict)
    """An agent task's own settings (``module:attr`` tasks), given to its class or function by name: JSON on the
    command line (``--demo-task-options '{"first_tool": "search_inbox"}'``), a table in the TOML file."""
    model: str = "policy"
    """Model name sent to the gateway: the stable policy name."""
    group_size: int = 8
    concurrency: int = 4
    """Groups kept in flight."""
    max_tokens: int = 16
    temperature: float = 1.0
    """Sampling temperature of the task's calls (1.0: the behaviour policy is the model's own distribution)."""
    context_words: int = 0
    """Numbers task: words of shared system message ahead of each prompt (an agent's long instructions)."""
    groups_per_step: int | None = None
    """The trainer's groups per step: paces generation to at most ``max_ahead`` steps ahead of training
    (see runner.Pacer). None = no pacing (``streamrl up`` sets it from the trainer's configuration)."""
    max_ahead: int = 1
    stall_s: float = 3.0
    """Pacing: let one more group through when the served version has not moved for this long (the
    trainer may be waiting for groups that carry signal). Set it above a training step's duration for
    a strictly synchronous loop (``max_ahead = 0``), where nothing may be generated during training."""
    until_version: int | None = None
    """Stop once this policy version (or a later one) has served ``stop_groups`` whole groups."""
    until_reward: float | None = 0.95
    """Stop once the last ``stop_groups`` whole groups, served by trained versions, average this reward
    (the demo task's maximum is 1.0; there every group has equal rewards and nothing is left to learn)."""
    stop_groups: int = 6
    max_seconds: float | None = 900.0
    seed: int = 0
    summary: str | None = None
    """Write the reward per version, failures and timings as JSON here at the end."""
    eval_every: int = 1
    """Tasks with a held-out set (arithmetic): evaluate every this-many-th version on it (0: never)."""
    eval_out: str | None = None
    """Append one JSON line per evaluated version here."""
    eval_problems: int = 64
    """Held-out problems scored per evaluated version (arithmetic: at most 256)."""
    reward: Literal["exact", "judge"] = "exact"
    """Arithmetic task: ``exact`` posts the exact-match reward; ``judge`` asks ``streamrl judge`` to score each
    group instead (``streamrl up`` then starts one). The figures printed stay exact-match in both."""

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            check_task_spec(self.task)
        elif self.task_options:
            raise ValueError(f"demo task options are for agent tasks (module:attr), not the built-in {self.task!r}")
        if not isinstance(self.task_options, dict):
            raise ValueError(f"demo task options must be a table of settings, not {self.task_options!r}")
        if self.group_size < 1 or self.concurrency < 1:
            raise ValueError("group_size and concurrency must be >= 1")
        if self.context_words < 0 or self.stall_s <= 0:
            raise ValueError("context_words must be >= 0 and stall_s > 0")
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.eval_every < 0:
            raise ValueError("eval_every must be >= 0")
        if self.reward not in ("exact", "judge") or (self.reward == "judge" and self.task != "arithmetic"):
            raise ValueError(f"demo reward must be exact, or judge with the arithmetic task, not {self.reward!r} "
                             f"with {self.task!r}")

    def make_task(self) -> Task:
        from .arithmetic import JUDGE_RUBRIC, ArithmeticTask
        from .calculator import CalculatorTask
        from .numbers import NumbersTask

        if self.task not in TASKS:
            return load_task(self.task, self.task_options, model=self.model, temperature=self.temperature)
        if self.task == "calculator":
            return CalculatorTask(model=self.model, max_tokens=max(self.max_tokens, 64), temperature=self.temperature)
        if self.task == "arithmetic":
            return ArithmeticTask(model=self.model, max_tokens=max(self.max_tokens, 32), temperature=self.temperature,
                                  held_out_size=self.eval_problems,
                                  judge_rubric=JUDGE_RUBRIC if self.reward == "judge" else None)
        return NumbersTask(model=self.model, max_tokens=self.max_tokens, temperature=self.temperature,
                           context_words=self.context_words)

    @property
    def limits(self) -> RunLimits:
        from .runner import RunLimits

        return RunLimits(self.until_version, self.until_reward, self.stop_groups, self.max_seconds)

    def pacer(self) -> Pacer | None:
        from .runner import Pacer

        return None if self.groups_per_step is None else Pacer(self.groups_per_step, self.max_ahead, self.stall_s)


def run_demo(url: str, config: DemoConfig, stop: threading.Event | None = None, emit=print) -> Board:
    """Run the demo producer to its limits, with the held-out evaluation of each version beside it where
    the task has a held-out set; writes the summary file when configured."""
    from .evaluate import Evaluator
    from .runner import run_groups

    task = config.make_task()
    evaluator = Evaluator(url, task, policy_name=config.model, every=config.eval_every,  # type: ignore[arg-type]
                          max_tokens=task.max_tokens, out=Path(config.eval_out) if config.eval_out else None,
                          emit=emit) if config.eval_every and getattr(task, "held_out", None) else None

    async def drop_evaluation_when_stopped(evaluating: asyncio.Task) -> None:
        """Told to stop (Ctrl-C): an evaluation in progress (a minute of a real model on the CPU) is dropped
        at once, not waited for."""
        while stop is not None and not stop.is_set() and not evaluating.done():
            await asyncio.sleep(0.1)
        evaluating.cancel()

    async def main() -> Board:
        done = asyncio.Event()
        evaluating = asyncio.create_task(evaluator.run(done)) if evaluator is not None else None
        dropping = asyncio.create_task(drop_evaluation_when_stopped(evaluating)) if evaluating and stop else None
        try:
            return await run_groups(url, task, group_size=config.group_size, concurrency=config.concurrency,
                                    limits=config.limits, pacer=config.pacer(), stop=stop, seed=config.seed,
                                    emit=emit)
        finally:
            if evaluating is not None and not evaluating.done():  # the version routed last is evaluated
                done.set()
            if evaluating is not None:
                stopped = stop is not None and stop.is_set()  # dropped then: its requests' errors are no news
                with contextlib.suppress(asyncio.CancelledError, *((Exception,) if stopped else ())):
                    await evaluating
            if dropping is not None:
                dropping.cancel()

    board = asyncio.run(main())
    if config.summary:
        path = Path(config.summary)
        path.parent.mkdir(parents=True, exist_ok=True)
        evaluation = [asdict(r) for r in evaluator.results] if evaluator is not None else []
        path.write_text(json.dumps({"config": asdict(config), **board.summary(), "evaluation": evaluation},
                                   indent=2))
    return board


DESCRIPTION = """\
The demo agent against a running gateway: keeps groups of trajectories in flight on a task (numbers,
arithmetic, calculator, or module:attr, an agent of your own), posts their rewards, and prints the reward
per policy version as versions arrive.

  streamrl demo --gateway http://127.0.0.1:8080 --task arithmetic
  streamrl demo --gateway http://127.0.0.1:8080 --task examples.tictactoe.agent:TicTacToeTask

`streamrl up --demo` runs it for you. Docs: docs/loop.md."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gateway", default="http://127.0.0.1:8080", help="gateway base URL")
    add_config_flags(p, DemoConfig)


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    return DemoConfig(**given(args, DemoConfig))


def gateway_unreachable(url: str, timeout_s: float = 10.0) -> str | None:
    """Why nothing answers HTTP at ``url`` (a refused connection, a timeout, a malformed URL), or None when
    something does: any answer passes, a 401 of a gateway with API keys included."""
    import httpx

    from .runner import describe

    try:
        httpx.get(f"{url.rstrip('/')}/health", timeout=timeout_s)
    except (httpx.TransportError, httpx.InvalidURL, httpx.UnsupportedProtocol) as exc:
        return describe(exc)
    return None


def run(args: argparse.Namespace) -> int:
    from streamrl.usage import EXIT_UNREACHABLE

    logging.getLogger("httpx").setLevel(logging.WARNING)
    config = config_from_args(args)
    if (why := gateway_unreachable(args.gateway)) is not None:  # one line, not 64 failed trajectories
        print(f"streamrl demo: no gateway answers at {args.gateway} ({why}): start one (`streamrl up`, "
              "`streamrl gateway`) or point --gateway at it", file=sys.stderr, flush=True)
        return EXIT_UNREACHABLE
    board = run_demo(args.gateway, config, emit=lambda s: print(s, flush=True))
    return 1 if board.failed else 0
