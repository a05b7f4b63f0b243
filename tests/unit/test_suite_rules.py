"""Rules of the test suite itself (tests/README.md): no test sleeps for longer than 1 s in one call
(wait for the event with a deadline instead), and the stored durations name only tests that exist."""
from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LONGEST_SLEEP_S = 1.0
SLEEP = re.compile(r"\bsleep\(\s*([0-9]+(?:\.[0-9]*)?)\s*\)")
"""A sleep of a literal number of seconds, in code or in a worker script held in a string."""


def test_no_test_sleeps_longer_than_a_second() -> None:
    long_sleeps = [f"{path.relative_to(ROOT)}:{text[:match.start()].count(chr(10)) + 1}: {match.group(0)}"
                   for path in sorted((ROOT / "tests").rglob("*.py")) if path.name != Path(__file__).name
                   for text in [path.read_text()] for match in SLEEP.finditer(text)
                   if float(match.group(1)) > LONGEST_SLEEP_S]
    assert not long_sleeps, "wait for the condition with a deadline instead:\n" + "\n".join(long_sleeps)


def test_stored_durations_name_test_files_that_exist() -> None:
    stored = json.loads((ROOT / "tests" / "durations.json").read_text())
    assert stored["run"]["date"] and stored["tests"]
    missing = sorted({name.split("::")[0] for name in stored["tests"]} - {
        str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")})
    assert not missing, f"tests/durations.json names files that are gone: {missing}; store a new run"
