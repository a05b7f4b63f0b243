"""Config dicts with a few fields changed, for tests that probe validation."""
from __future__ import annotations

import copy
from typing import Any, Mapping


def with_changes(data: Mapping[str, Any], **changes: Any) -> dict[str, Any]:
    """A deep copy of ``data`` with dotted-key changes, e.g. ``with_changes(cfg, **{"parallel.tp": 3})``."""
    result = copy.deepcopy(dict(data))
    for dotted, value in changes.items():
        *path, key = dotted.split(".")
        target = result
        for part in path:
            target = target.setdefault(part, {})
        target[key] = value
    return result
