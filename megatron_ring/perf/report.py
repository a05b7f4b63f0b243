"""Tables (rich on a terminal, Markdown for the docs) and number formats shared by the planner and benchmarks.

``rich`` is optional (the ``bench`` extra): without it the tables print as Markdown.
"""
from __future__ import annotations

from typing import Any, Sequence

Row = Sequence[Any]


def markdown_table(columns: Sequence[str], rows: Sequence[Row]) -> str:
    """A GitHub Markdown table."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def print_table(title: str, columns: Sequence[str], rows: Sequence[Row]) -> None:
    """Print with rich when it is installed, as Markdown otherwise."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(f"\n{title}\n{markdown_table(columns, rows)}")
        return
    table = Table(title=title, title_justify="left")
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*(str(c) for c in row))
    Console(width=200).print(table)


def fmt_time(seconds: float) -> str:
    """``12.3 ms`` / ``4.56 s`` / ``78.9 us``."""
    if seconds >= 1:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"


def fmt_bytes(n: float) -> str:
    """Decimal units: ``3.36 TB``, ``80 GB``."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_rate(n: float) -> str:
    """``1.2M`` / ``345k`` / ``12.3``."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"
