"""One rank of an lm-eval run with the model ``megatron_ring``: lm-eval's own command line, on every rank.

Started by a launcher on ``tp * cp * pp`` processes (``megatron-ring lm-eval`` checks and starts it)::

    torchrun --nproc_per_node 2 -m megatron_ring.eval.harness_main --model megatron_ring \\
        --model_args checkpoint=...,cp=2 --tasks ring_passkey --output_path results/

The arguments are lm-eval's. Every rank registers the model, adds the shipped tasks' folder to
``--include_path`` and runs lm-eval's CLI; ranks other than 0 drop ``--output_path`` and
``--log_samples`` so that one process writes the results.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional, Sequence

from megatron_ring.integrations.deepspeed.process_group import launch_env
from megatron_ring.parallel.groups import leave_distributed

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
"""The shipped task YAMLs (ring_passkey, ring_needle_choice, ring_corpus_ppl)."""
WRITERS = {"--output_path": True, "-o": True, "--log_samples": False, "-s": False}
"""lm-eval flags that make a process write files -> whether the flag takes a value."""
LAUNCHER_FLAGS = {"--local_rank": True}
"""Flags the deepspeed launcher adds to every rank's arguments (its value is in LOCAL_RANK too); not lm-eval's."""


def with_shipped_tasks(argv: Sequence[str]) -> list[str]:
    """``argv`` with the shipped tasks' folder in ``--include_path`` (appended to a given one)."""
    argv = list(argv)
    for i, arg in enumerate(argv):
        if arg == "--include_path" and i + 1 < len(argv):
            argv[i + 1] = f"{argv[i + 1]}:{TASKS_DIR}"
            return argv
        if arg.startswith("--include_path="):
            argv[i] = f"{arg}:{TASKS_DIR}"
            return argv
    return argv + ["--include_path", str(TASKS_DIR)]


def without_flags(argv: Sequence[str], flags: dict[str, bool]) -> list[str]:
    """``argv`` without ``flags`` (flag -> whether it takes a value), given as ``--flag value`` or ``--flag=value``."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in flags:
            skip = flags[name] and "=" not in arg
            continue
        out.append(arg)
    return out


def harness_main(argv: Optional[Sequence[str]] = None) -> int:
    """Run lm-eval's command line with ``argv`` on this rank; return its exit status."""
    from lm_eval.__main__ import cli_evaluate

    import megatron_ring.eval.harness_model  # noqa: F401  (registers --model megatron_ring)

    argv = with_shipped_tasks(without_flags(sys.argv[1:] if argv is None else argv, LAUNCHER_FLAGS))
    if launch_env()["rank"] != 0:
        argv = without_flags(argv, WRITERS)
    sys.argv = ["lm-eval", *argv]
    try:
        cli_evaluate()
    except SystemExit as stop:
        if stop.code not in (0, None):
            return int(stop.code) if isinstance(stop.code, int) else 1
    leave_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(harness_main())
