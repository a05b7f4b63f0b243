"""Configs shipped with the package: ``configs/`` of the source tree, installed as ``megatron_ring.configs``."""
from __future__ import annotations

from importlib import resources
from pathlib import Path

from megatron_ring.config.strict import ConfigError


def shipped_dir() -> Path | None:
    """The directory of the shipped configs (``deepspeed/``, ``megatron/``), or None if not installed."""
    try:
        root = resources.files("megatron_ring.configs")
    except ModuleNotFoundError:
        return None
    path = Path(str(root))
    return path if path.is_dir() else None


def find_config(name: str | Path, kind: str = "deepspeed") -> Path:
    """A config file: ``name`` relative to the working directory, else a shipped ``<kind>/<name>``.

    Raises :class:`ConfigError` naming every place that was looked in.
    """
    given = Path(name)
    tried = [given if given.is_absolute() else Path.cwd() / given]
    shipped = shipped_dir()
    if not given.is_absolute() and shipped is not None:
        tried.append(shipped / kind / given.name)
    for path in tried:
        if path.is_file():
            return path
    where = "" if shipped is not None else " (the package's shipped configs are not installed)"
    raise ConfigError(f"config {str(name)!r} not found; looked for {', '.join(str(p) for p in tried)}{where}")
