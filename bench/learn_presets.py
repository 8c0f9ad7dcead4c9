"""The learning benchmark's presets (``bench/learn_bench.py``): small named, typed configurations of one
``streamrl up --demo`` run, so that a figure in docs/benchmarks.md names its settings in one word and a user
writes their own in TOML (``--preset-file FILE``) instead of thirty flags.

A preset file holds one table per preset; ``base`` starts it from a named one and the other keys are fields::

    [long-1k]
    base = "long-tail"
    max_tokens = 1024
    levels = [0.3, 0.5]

Every field is also a flag of ``learn_bench.py run`` (``--max-tokens 1024``), applied over the preset.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import tomllib
import typing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

LAYOUTS = {
    # engine device, vLLM memory fraction, trainer device
    "two-gpu": ("0", 0.85, "cuda:1"),
    "one-gpu": ("0", 0.35, "cuda:0"),
    "cpu": (None, None, "cpu"),
}
"""Where vLLM and the trainer go: two GPUs, one shared GPU (vLLM capped so the trainer fits beside it), the CPU."""


@dataclass(frozen=True)
class Preset:
    """One run's settings but its mode and seed. The defaults are the synthetic loop of docs/benchmarks.md
    ("The loop on GPUs": a random 1.5B model on the numbers task, two GPUs), which the named presets change."""

    name: str = "custom"
    description: str = ""
    """What the preset is for and what it cannot measure (``learn_bench.py presets`` prints it)."""
    model: str | None = None
    """A packaged model (``smollm2-135m``, converted into --model-cache) or a checkpoint path; none: a random
    model of ``shape`` (the tiny-model builder, final norm sharpened as in the demo model)."""
    shape: str = "qwen2.5-1.5b"
    vocab_size: int = 2048
    layout: str = "two-gpu"
    """two-gpu, one-gpu or cpu (where vLLM and the trainer go)."""
    task: str = "numbers"
    """The demo task: numbers, calculator or arithmetic, or an agent task as ``module:attr`` (examples/); the
    score is the held-out evaluation where the task has a held-out set (arithmetic, the examples' agents)."""
    task_options: dict[str, Any] = field(default_factory=dict)
    """An agent task's own settings (the demo's ``task_options``), e.g. ``{first_tool = "search_inbox"}``."""
    max_tokens: int = 64
    """Reply tokens per call at most."""
    context_words: int = 0
    """Numbers task: shared system message ahead of each prompt (training pays for it, vLLM's prefix cache not)."""
    eval_every: int = 1
    """Tasks with a held-out set: evaluate every N-th version (0: never; the served reward is scored then)."""
    eval_problems: int = 64
    """Held-out problems per evaluation."""
    learning_rate: float = 2e-3
    group_size: int = 8
    groups_per_step: int = 4
    lora_rank: int = 16
    max_lag: int = 4
    micro_batch_tokens: int = 4096
    row_tokens: int | None = None
    """The trainer's longest packed row (none: one row per micro-batch)."""
    concurrency: int = 16
    """Groups in flight."""
    max_ahead: int = 2
    """Pipeline mode: training steps generation may run ahead (sync mode always 0)."""
    stall_s: float = 3.0
    """Pacer: one more group when the version has not moved for this long; above a training step for a
    strictly synchronous sync mode."""
    max_seconds: float = 240.0
    """Each run's demo time (after the stack is up)."""
    until_reward: float = 0.8
    """A run stops early when its served reward reaches this (above 1: never, every run takes max_seconds)."""
    stop_groups: int = 6
    max_model_len: int = 1024
    engine_args: str = ""
    """Extra vLLM flags, e.g. --enforce-eager (give it as --engine-args=--enforce-eager)."""
    shared_engine: bool = True
    """One vLLM server for every run, started once (off: each run starts its own, e.g. with replica_gpus)."""
    engines: int = 1
    """vLLM replicas on the engine GPU behind the one gateway (shared engine only)."""
    token_capture: bool = True
    """The engine hands the gateway tokens as capture frames (off: a plain vLLM, tokens from its JSON)."""
    replica_gpus: str = ""
    """Comma-separated GPUs, one vLLM replica each, started by every run (not with shared_engine)."""
    trainer_gpus: str = ""
    """Comma-separated GPUs, one trainer rank each (torchrun, NCCL)."""
    judge: bool = False
    """Start ``streamrl judge`` beside the trainer (``streamrl up --judge``) for a task whose rewards are the
    judge's (``t.judge``). Without a held-out set the score is then the judged reward of the groups each step
    trained on (the trainer's history): the producer never sees those rewards."""
    warmup: bool = False
    """First an untimed run to one trained version, so that first-use costs land in no timed run."""
    sft_examples: int = 512
    """Modes that start from an SFT warm-up (``sft-pipeline``, ``sft-sync``): how many correct answers the task
    writes itself (its ``demonstration``; training problems only, never held-out ones) for ``streamrl sft``."""
    sft_epochs: int = 2
    sft_learning_rate: float = 1e-3
    sft_step_tokens: int = 2048
    """Tokens per SFT optimizer step (a few hundred short answers are then some twenty steps)."""
    levels: tuple[float, ...] = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
    """Score levels whose first crossing is timed."""
    times_s: tuple[float, ...] = (30.0, 60.0, 90.0, 120.0)
    """Seconds since the demo's start at which each run's last score is read."""

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(sorted(LAYOUTS))}, not {self.layout!r}")
        if self.replica_gpus and self.shared_engine:
            raise ValueError("replica_gpus starts each run's own replicas: not with a shared engine "
                             "(shared_engine = false, --no-shared-engine)")
        if not self.levels or not self.times_s:
            raise ValueError("levels and times_s must not be empty")
        if self.sft_examples < 1 or self.sft_epochs < 1 or self.sft_step_tokens < 1 or self.sft_learning_rate <= 0:
            raise ValueError("sft_examples, sft_epochs, sft_step_tokens and sft_learning_rate must be positive")


SHORT = Preset(
    name="short",
    description="SmolLM2-135M-Instruct on arithmetic word problems, one H200 shared by vLLM and the trainer "
                "(loop-real's settings): replies of up to 128 tokens, training a quarter of a synchronous step, "
                "so pipelining can win little; the target is that it loses nothing. Held-out: 256 problems.",
    model="smollm2-135m", layout="one-gpu", task="arithmetic", eval_problems=256, learning_rate=5e-4,
    group_size=16, groups_per_step=8, lora_rank=16, concurrency=16, max_tokens=128, max_ahead=2, stall_s=10.0,
    micro_batch_tokens=16384, max_model_len=1024, max_seconds=130.0, until_reward=2.0,
    times_s=(30.0, 60.0, 90.0, 120.0),
)
LONG_TAIL = replace(
    SHORT, name="long-tail",
    description="short with replies of up to 768 tokens and 32 groups in flight: a synchronous batch waits for "
                "its longest reply, which pipelining hides. Held-out: 256 problems.",
    max_tokens=768, concurrency=32, max_model_len=2048, max_seconds=150.0,
    times_s=(30.0, 60.0, 90.0, 120.0, 150.0),
)
AGENT = replace(
    SHORT, name="agent",
    description="A multi-turn agent: tic-tac-toe against a scripted opponent of strength 0.5 "
                "(examples/tictactoe/, one chat turn per move, up to 5 moves), on SmolLM2-135M. Reward win 1, "
                "draw 0.5, loss 0, an illegal move -1 (+0.2 per legal move before it). Held-out: 32 games from "
                "fixed seeds, each played whole by one version (the score is their mean reward).",
    task="examples.tictactoe.agent:TicTacToeTask", max_tokens=16, max_seconds=300.0,
    levels=(0.0, 0.2, 0.4, 0.6), times_s=(60.0, 120.0, 180.0, 240.0, 300.0),
)
EMAIL_SEARCH = replace(
    AGENT, name="email-search",
    description="ART-E's task with the OpenAI Agents SDK (examples/email_search/): search_inbox and read_email over "
                "3,000 generated emails, questions with one exact answer, the first call made a search (a "
                "foothold: task_options first_tool), on SmolLM2-135M. Reward exact answer 1, right email read "
                "0.25, a search hit 0.1. Held-out: 32 questions (the score is their mean reward).",
    task="examples.email_search.agent:EmailTask", task_options={"first_tool": "search_inbox"}, max_tokens=128,
    max_model_len=4096, levels=(0.1, 0.25, 0.5),
)
SHOP_AGENT = replace(
    AGENT, name="shop-agent",
    description="The shop assistant with the OpenAI Agents SDK (examples/agents_sdk/): a price_of function tool, "
                "then the total of an order, the first call made a price look-up (task_options first_tool), on "
                "SmolLM2-135M. Reward (examples/shop.py) exact total 1, a tool answered with the total 0.6, with the asked "
                "item's price 0.3, at all 0.1. Held-out: the example's 32 fixed orders.",
    task="examples.agents_sdk.agent:ShopAgentTask", task_options={"first_tool": "price_of"}, max_tokens=128,
    max_model_len=2048, levels=(0.1, 0.3, 0.5),
)
SHOP_AGENT_STEPS = replace(
    SHOP_AGENT, name="shop-agent-steps",
    description="shop-agent with its ladder (task_options tool_steps): the first call made a price look-up, the "
                "second a multiply, whose answer is the episode's; SmolLM2-135M fills both calls' arguments itself "
                "and sometimes gets the total (examples/agents_sdk/README.md), which first_tool alone never did.",
    task_options={"tool_steps": ["price_of", "multiply"]},
)
SHOP_LANGGRAPH = replace(
    SHOP_AGENT, name="shop-langgraph",
    description="shop-agent's task and reward as a LangGraph ReAct graph with LangChain's ChatOpenAI "
                "(examples/langgraph_react/), the first call a price look-up, on SmolLM2-135M.",
    task="examples.langgraph_react.agent:ShopGraphTask",
)
SHOP_MCP = replace(
    SHOP_AGENT, name="shop-mcp",
    description="shop-agent's task and reward with its tools discovered from an MCP server over stdio (SQLite "
                "behind it; examples/mcp_tools/), the first call a price look-up, on SmolLM2-135M.",
    task="examples.mcp_tools.agent:McpShopTask",
)
AUTOTASK = replace(
    AGENT, name="autotask",
    description="A task described in one line with no reward function (examples/autotask/, its default "
                "description): SmolLM2-135M writes 32 inputs, answers them, and streamrl judge (the base model "
                "through the gateway) scores each group relative to itself. No held-out set: the score is the "
                "judged reward of the groups each step trained on.",
    task="examples.autotask.agent:AutoTask", judge=True, max_tokens=128, group_size=8, groups_per_step=16,
    max_model_len=8192,  # the judge reads a whole group at once: 8 inputs and answers, the rubric, its reply
    levels=(0.3, 0.5, 0.7),
)
WARM_START = replace(
    SHORT, name="warm-start",
    description="short's settings in runs of 70 s, for RL from an SFT warm-up against RL from the base model "
                "(--modes pipeline,sft-pipeline): the warm-up is streamrl sft on 512 correct answers the task writes "
                "itself, its wall time on the run's clock. Held-out: 256 problems.",
    max_seconds=70.0, levels=(0.3, 0.5, 0.7), times_s=(15.0, 30.0, 45.0, 60.0, 70.0),
)
TINY = Preset(
    name="tiny",
    description="The CPU smoke run: the tiny random model (streamrl tiny-model's, sharpened like the demo "
                "model) on the numbers task, a few groups of 8, runs of a few seconds. Checks the harness, "
                "measures nothing. The numbers task has no held-out set: the score is the served reward.",
    model=None, shape="tiny", layout="cpu", task="numbers", learning_rate=2e-2, group_size=8, groups_per_step=2,
    lora_rank=8, concurrency=2, max_tokens=16, max_ahead=1, stall_s=10.0, micro_batch_tokens=4096,
    max_seconds=12.0, until_reward=2.0, max_model_len=1024,
    levels=(0.5, 0.6, 0.7), times_s=(4.0, 8.0, 12.0),
)
PRESETS: dict[str, Preset] = {p.name: p for p in (SHORT, LONG_TAIL, AGENT, EMAIL_SEARCH, SHOP_AGENT, SHOP_AGENT_STEPS,
                                                  SHOP_LANGGRAPH, SHOP_MCP, AUTOTASK, WARM_START, TINY)}
"""The named presets, by name."""


def _coerce(name: str, tp: Any, value: Any, where: str) -> Any:
    """A TOML value as field ``name`` of type ``tp`` wants it (ints for floats, lists for tuples), or ValueError."""
    if typing.get_origin(tp) is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: {name} must be a table, not {value!r}")
        return dict(value)
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if args and typing.get_origin(tp) is not tuple:  # X | None
        tp = args[0]
    if typing.get_origin(tp) is tuple:
        if not isinstance(value, list):
            raise ValueError(f"{where}: {name} must be a list, not {value!r}")
        return tuple(_coerce(name, typing.get_args(tp)[0], v, where) for v in value)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ValueError(f"{where}: {name} must be {tp.__name__}, not {value!r}")
    return value


def preset_from_table(name: str, table: dict[str, Any], known: dict[str, Preset], where: str = "preset") -> Preset:
    """A preset from a TOML table: ``base`` (a name in ``known``, default the plain defaults) and fields over it."""
    table = dict(table)
    base_name = table.pop("base", None)
    if base_name is not None and base_name not in known:
        raise ValueError(f"{where}: base {base_name!r} is no preset ({', '.join(known)})")
    hints = typing.get_type_hints(Preset)
    fields = {f.name for f in dataclasses.fields(Preset)}
    values = {}
    for key, value in table.items():
        if key not in fields:
            near = difflib.get_close_matches(key, fields, n=1)
            raise ValueError(f"{where}: unknown key {key!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
        values[key] = _coerce(key, hints[key], value, where)
    return replace(known[base_name] if base_name else Preset(), **{"name": name, **values})


def field_defaults() -> dict[str, Any]:
    """Each preset field's default as a result file writes it (``asdict``, through JSON): what an older file that
    lacks the field ran with."""
    return json.loads(json.dumps(dataclasses.asdict(Preset())))


def load_preset_file(path: Path, known: dict[str, Preset] | None = None) -> dict[str, Preset]:
    """Every table of a TOML file as a preset; a table may start from a built-in or an earlier table."""
    with path.open("rb") as f:
        data = tomllib.load(f)
    presets = dict(known if known is not None else PRESETS)
    loaded = {}
    for name, table in data.items():
        if not isinstance(table, dict):
            raise ValueError(f"{path}: {name!r} must be a table ([{name}]) of preset fields")
        loaded[name] = presets[name] = preset_from_table(name, table, presets, where=f"{path} [{name}]")
    if not loaded:
        raise ValueError(f"{path}: no preset table in it")
    return loaded


def preset_toml(preset: Preset) -> str:
    """A preset as the TOML table that makes it again (``learn_bench.py presets`` prints these)."""
    lines = [f"[{preset.name}]"]
    for f in dataclasses.fields(Preset):
        value = getattr(preset, f.name)
        if f.name == "name" or value is None:
            continue
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, tuple):
            text = "[" + ", ".join(repr(v) for v in value) + "]"
        elif isinstance(value, dict):
            if not value:
                continue
            text = "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in value.items()) + "}"
        elif isinstance(value, str):
            text = '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
        else:
            text = repr(value)
        lines.append(f"{f.name} = {text}")
    return "\n".join(lines)

