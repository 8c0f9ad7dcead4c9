"""A generated mailbox with facts in it, in SQLite FTS5, and questions whose answers are in exactly one email.

Every ``fact_every``-th email states a fact (a flight's confirmation code, a meeting's room, an invoice's
amount) under names and numbers drawn so that no two facts collide; the others are filler. The questions
are built from the facts, so each has one exact answer and one email that holds it.
"""

from __future__ import annotations

import random
import re
import sqlite3
from dataclasses import dataclass
from pathlib import Path

FIRST = ("Ada", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jun", "Kim", "Lea", "Max", "Nia", "Omar",
         "Pia", "Raj", "Sol", "Tess", "Uma", "Vik", "Wen", "Yara", "Zed")
LAST = ("Abbott", "Baker", "Chen", "Diaz", "Evans", "Fischer", "Garcia", "Hughes", "Ito", "Jensen", "Khan", "Lopez",
        "Moreau", "Novak", "Okafor", "Park", "Quinn", "Rossi", "Silva", "Tanaka")
CITIES = ("Lisbon", "Oslo", "Nairobi", "Lima", "Hanoi", "Quito", "Dublin", "Seoul", "Perth", "Cairo", "Austin",
          "Porto", "Riga", "Tunis", "Bergen", "Kyoto")
PROJECTS = ("Apollo", "Beacon", "Cedar", "Delta", "Ember", "Falcon", "Granite", "Harbor", "Iris", "Juniper", "Kestrel",
            "Lantern", "Meridian", "Nimbus", "Orchid", "Pylon", "Quartz", "Raven", "Summit", "Tundra")
FILLER = ("Weekly newsletter", "Lunch on Friday?", "Your subscription", "Team photos", "Parking update",
          "Office plants", "Book club", "Printer on floor 3", "Holiday schedule", "Coffee machine")
WORDS = ("please", "note", "team", "update", "thanks", "schedule", "reminder", "office", "week", "share", "plan",
         "review", "draft", "notes", "agenda", "later", "today", "soon", "details", "attached")


@dataclass(frozen=True, slots=True)
class Email:
    id: str
    sender: str
    date: str
    subject: str
    body: str


@dataclass(frozen=True, slots=True)
class Question:
    question: str
    answer: str
    email_id: str
    """The email that holds the answer."""


def _date(rng: random.Random) -> str:
    return f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def _filler(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(12, 30))).capitalize() + "."


def generate(n_emails: int = 3000, *, seed: int = 0, fact_every: int = 3) -> tuple[list[Email], list[Question]]:
    """``n_emails`` emails, every ``fact_every``-th with a fact, and one question per fact."""
    if n_emails < 1 or fact_every < 1:
        raise ValueError("n_emails and fact_every must be >= 1")
    rng = random.Random(seed)
    emails: list[Email] = []
    questions: list[Question] = []
    used: set[tuple[str, ...]] = set()
    for i in range(n_emails):
        eid = f"m{i:05d}"
        sender = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
        date = _date(rng)
        if i % fact_every:
            emails.append(Email(eid, sender, date, rng.choice(FILLER), _filler(rng)))
            continue
        kind = rng.randrange(3)
        if kind == 0:
            city, day, code = rng.choice(CITIES), _date(rng), "".join(rng.choices("ABCDEFGHJKLMNPQRSTUVWXYZ23456789", k=6))
            key: tuple[str, ...] = ("flight", city, day)
            subject, body = f"Flight to {city} confirmed", (f"Your flight to {city} on {day} is booked. "
                                                            f"Confirmation code: {code}. {_filler(rng)}")
            q = Question(f"What is the confirmation code of my flight to {city} on {day}?", code, eid)
        elif kind == 1:
            project, room = rng.choice(PROJECTS), f"{rng.choice('ABCDE')}{rng.randint(100, 499)}"
            key = ("meeting", project, sender)
            subject, body = f"{project} sync", (f"Hi, the {project} meeting is in room {room}. {_filler(rng)} "
                                                f"{sender.split()[0]}")
            q = Question(f"Which room is {sender}'s {project} meeting in?", room, eid)
        else:
            number, amount = f"INV-{rng.randint(1000, 9999)}", str(rng.randint(40, 9000))
            key = ("invoice", number)
            subject, body = f"Invoice {number}", f"Invoice {number} over {amount} dollars is due. {_filler(rng)}"
            q = Question(f"How many dollars is invoice {number} for?", amount, eid)
        if key in used:  # the same question would have two answers: a filler email instead
            emails.append(Email(eid, sender, date, rng.choice(FILLER), _filler(rng)))
            continue
        used.add(key)
        emails.append(Email(eid, sender, date, subject, body))
        questions.append(q)
    return emails, questions


def write_index(path: Path, emails: list[Email]) -> Path:
    """The mailbox as an SQLite FTS5 table (written whole under another name, then renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    with sqlite3.connect(tmp) as db:
        db.execute("CREATE VIRTUAL TABLE emails USING fts5(id UNINDEXED, sender, date UNINDEXED, subject, body)")
        db.executemany("INSERT INTO emails VALUES (?, ?, ?, ?, ?)",
                       [(e.id, e.sender, e.date, e.subject, e.body) for e in emails])
    tmp.replace(path)
    return path


_WORD = re.compile(r"\w+")


class Inbox:
    """Read-only searches over an index ``write_index`` made."""

    def __init__(self, path: Path) -> None:
        self.db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)

    def search(self, keywords: str, limit: int = 5) -> list[dict[str, str]]:
        """Emails matching all of ``keywords`` (words only: FTS5's query syntax is not exposed), best first."""
        words = _WORD.findall(keywords)
        if not words:
            return []
        query = " AND ".join(f'"{w}"' for w in words)
        rows = self.db.execute("SELECT id, sender, date, subject, snippet(emails, 4, '', '', '...', 12) FROM emails "
                               "WHERE emails MATCH ? ORDER BY rank LIMIT ?", (query, limit)).fetchall()
        return [dict(zip(("id", "sender", "date", "subject", "snippet"), row, strict=True)) for row in rows]

    def read(self, email_id: str) -> Email | None:
        row = self.db.execute("SELECT id, sender, date, subject, body FROM emails WHERE id = ?",
                              (email_id.strip(),)).fetchone()
        return Email(*row) if row else None


def answer_matches(reply: str, answer: str) -> bool:
    """Exact match, forgiving of case and surrounding words: the answer appears in the reply as a whole word."""
    return re.search(rf"(?<!\w){re.escape(answer)}(?!\w)", reply, re.IGNORECASE) is not None
