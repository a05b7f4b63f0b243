"""Text files named by paths: files as given, folders searched for some suffixes (standard library only)."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence


def corpus_files(paths: Sequence[str | Path], suffixes: Sequence[str], *, field: str = "data.paths") -> list[Path]:
    """The text files named by ``paths``: files as given, folders searched recursively for ``suffixes``;
    ValueError naming ``field`` (the config key or flag of ``paths``) when an entry is missing or none is found."""
    files: list[Path] = []
    for entry in paths:
        path = Path(entry)
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files.extend(sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in suffixes
                                and not any(part.startswith(".") or part == "__pycache__" for part in p.parts)))
        else:
            raise ValueError(f"{field} entry {str(path)!r} is neither a file nor a folder")
    if not files:
        raise ValueError(f"{field} {list(map(str, paths))} hold no file ending in {list(suffixes)}")
    return files
