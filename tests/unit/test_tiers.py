"""The two tiers' test modules have distinct names: pytest imports each by its basename (the tiers are not
packages), so a second ``test_x.py`` in the other tier stops the whole run at collection."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_basename_in_both_tiers() -> None:
    names = Counter(p.name for tier in ("unit", "integration") for p in (TESTS / tier).glob("test_*.py"))
    assert not [n for n, k in names.items() if k > 1], "rename one of each pair"
    assert not list(TESTS.glob("test_*.py")), "every test module lives in tests/unit or tests/integration"
