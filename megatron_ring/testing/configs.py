"""Config dicts with a few fields changed, for tests that probe validation."""
from __future__ import annotations

import copy
import json
from pathlib import Path
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


def hf_inference_config(path: Path, checkpoint: str, *, cp: int = 1, tp: int = 1) -> Path:
    """Write an inference config (hf runner, fp32) of ``checkpoint`` at ``tp`` x ``cp`` to ``path``; a small
    workload of random prompts (a command such as ``megatron-ring niah`` replaces it)."""
    path.write_text(json.dumps({"dtype": "fp32", "replace_with_kernel_inject": False, "megatron_ring": {
        "model": {"runner": "hf", "config": {"checkpoint": checkpoint}},
        "layout": {"tp": tp, "cp": cp, "dp": 1, "pp": 1},
        "workload": {"batch": 1, "prompt_len": 64, "new_tokens": 4}}}, indent=2))
    return path
