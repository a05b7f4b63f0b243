"""``megatron-ring serve CONFIG``: check the config in this process, then become the launcher of its ranks.

The launcher (torchrun, or DeepSpeed's) replaces this process (``exec``), so a signal sent to the
command reaches the launcher, which passes it to the ranks: rank 0 drains (serve_main.py).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from megatron_ring.config import ConfigError
from megatron_ring.inference.compare import LAUNCHERS, job_env, module_command, world_size_of
from megatron_ring.runtime.args import usage_error
from megatron_ring.serving.serve_main import FLAGS, add_serve_flags, serve_spec


def serve_cli_main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-ring serve", description="an OpenAI-compatible server of an "
                                     "inference config's model over its tp x cp ranks (rank 0 serves HTTP)")
    parser.add_argument("config", help="inference config (configs/deepspeed/*.json), runner hf")
    parser.add_argument("--launcher", choices=LAUNCHERS, default="torchrun")
    add_serve_flags(parser)
    args = parser.parse_args(argv)
    config = Path(args.config)
    if not config.is_file():
        return usage_error(parser, f"config {str(config)!r} does not exist")
    try:
        world = world_size_of(config)
        serve_spec(str(config), world, args)
    except ConfigError as err:
        print(f"megatron-ring serve: config error, nothing was started:\n{err}", file=sys.stderr, flush=True)
        return 2
    forwarded = ["--config", str(config)]
    for flag in FLAGS:
        value = getattr(args, flag)
        if value is not None:
            forwarded += [f"--{flag.replace('_', '-')}", str(value)]
    cmd = module_command("megatron_ring.serving.serve_main", forwarded, nprocs=world, launcher=args.launcher)
    print("+ " + " ".join(cmd), flush=True)
    os.execvpe(cmd[0], cmd, job_env())
    return 0  # not reached
