"""JSON Lines input (one JSON value a line), read for prompts and for training data.

Importing this module needs the standard library only.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable


def json_lines(path: Path, error: type[Exception], where: Callable[[int], str]) -> list[tuple[int, Any]]:
    """``(line number, value)`` for each non-blank line of ``path`` (UTF-8, numbered from 1); at the first
    line that is not JSON, ``error("<where(number)>: not valid JSON (<reason> at column <c>)")``."""
    rows = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                rows.append((number, json.loads(line)))
            except json.JSONDecodeError as err:
                raise error(f"{where(number)}: not valid JSON ({err.msg} at column {err.colno})") from None
    return rows
