"""The email-search agent (ART•E's task) with the OpenAI Agents SDK: ``search_inbox`` and ``read_email``
over the generated mailbox (mailbox.py, SQLite FTS5), the SDK's loop, the model at the gateway.

Reward (``reward="exact"``): 1.0 when the final answer holds the exact answer; 0.25 when the agent read
the email that holds it but answered wrong; 0.1 when a search found anything; else 0. With ``reward="judge"``
``streamrl judge`` scores each group against a rubric that states the expected answer (docs/judge.md).

Train:    streamrl up --demo --demo-task examples.email_search.agent:EmailTask --model smollm2-135m
Evaluate: python -m streamrl.producers.evaluate examples.email_search.agent:EmailTask --gateway http://127.0.0.1:8080
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    RunConfig,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError
from pydantic import Field

from streamrl.producers.agent import AgentTask
from streamrl.producers.client import AsyncTrajectory

from .mailbox import Inbox, Question, answer_matches, generate, write_index

set_tracing_disabled(True)  # traces go to OpenAI's servers by default; the gateway's log is the record here

INSTRUCTIONS = ("You answer questions about the user's mailbox. Search it with search_inbox (a few keywords), "
                "open a promising email with read_email, then reply with the answer only.")
HELD_OUT = 32


def default_database(n_emails: int, seed: int) -> Path:
    cache = Path(os.environ.get("STREAMRL_CACHE", Path.home() / ".cache" / "streamrl"))
    return cache / "examples" / f"mailbox-{n_emails}-{seed}.sqlite"


@dataclass
class EmailTask(AgentTask):
    model: str = "policy"
    temperature: float = 1.0
    max_tokens: int = 128
    max_turns: int = 6
    n_emails: int = 3000
    mailbox_seed: int = 0
    reward: Literal["exact", "judge"] = "exact"
    first_tool: str | None = None
    """Make the first call use this tool (named ``tool_choice``, enforced by vLLM's guided decoding; the SDK
    resets it after the call): a foothold for a model that does not call tools on its own yet."""
    seed: int | None = None
    """Sampling seed of every call (reproducible episodes)."""
    database: Path | None = None
    """Where the mailbox's index goes (default: under the streamrl cache, one per size and seed)."""
    held_out: list[Question] = field(init=False)

    def __post_init__(self) -> None:
        if self.reward not in ("exact", "judge"):
            raise ValueError(f"reward must be exact or judge, not {self.reward!r}")
        emails, questions = generate(self.n_emails, seed=self.mailbox_seed)
        if len(questions) <= HELD_OUT:
            raise ValueError(f"{self.n_emails} emails give {len(questions)} questions: more than {HELD_OUT} needed")
        path = self.database or default_database(self.n_emails, self.mailbox_seed)
        if not path.exists():
            write_index(path, emails)
        self.inbox = Inbox(path)
        self.held_out, self.train = questions[:HELD_OUT], questions[HELD_OUT:]

    def sample(self, rng: random.Random) -> Question:
        return rng.choice(self.train)

    async def play(self, t: AsyncTrajectory, problem: Question, *, model: str, temperature: float) -> float | None:
        inbox, opened = self.inbox, set[str]()
        found = False

        @function_tool
        def search_inbox(keywords: Annotated[str, Field(max_length=60)]) -> str:
            """Search the mailbox: the emails that contain all the keywords, best match first.

            Args:
                keywords: A few words the email should contain.
            """
            nonlocal found
            hits = inbox.search(keywords)
            found = found or bool(hits)
            return json.dumps(hits) if hits else "no email matches all of these words"

        @function_tool
        def read_email(email_id: Annotated[str, Field(max_length=12)]) -> str:
            """Read one email in full.

            Args:
                email_id: The id a search returned, e.g. m00042.
            """
            email = inbox.read(email_id)
            if email is None:
                return f"no email {email_id!r}"
            opened.add(email.id)
            return f"From: {email.sender}\nDate: {email.date}\nSubject: {email.subject}\n\n{email.body}"

        agent = Agent(name="email assistant", instructions=INSTRUCTIONS, tools=[search_inbox, read_email],
                      model=OpenAIChatCompletionsModel(model=model, openai_client=t.client),
                      model_settings=ModelSettings(temperature=temperature, max_tokens=self.max_tokens,
                                                   tool_choice=self.first_tool,
                                                   extra_args=None if self.seed is None else {"seed": self.seed}))
        try:
            result = await Runner.run(agent, problem.question, max_turns=self.max_turns,
                                      run_config=RunConfig(tracing_disabled=True))
            answer = str(result.final_output or "")
        except (MaxTurnsExceeded, ModelBehaviorError):
            answer = ""
        if self.reward == "judge" and t.purpose == "train":
            t.judge(f"The question was: {problem.question} The correct answer is {problem.answer}. Score 1 for a "
                    f"final answer that states it, 0 otherwise; among wrong answers, prefer those that found the "
                    f"right email.")
            return None
        if answer_matches(answer, problem.answer):
            return 1.0
        return 0.25 if problem.email_id in opened else 0.1 if found else 0.0
