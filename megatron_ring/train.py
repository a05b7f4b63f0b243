"""Training as Megatron users start it: one module for the ranks and for the command that launches them.

    torchrun --nproc_per_node 4 -m megatron_ring.train configs/train/megatron_pp2_cp2.yaml   # each rank
    deepspeed --num_gpus 4 --module megatron_ring.train configs/train/megatron_pp2_cp2.yaml  # the same
    megatron-ring train configs/train/megatron_pp2_cp2.yaml --nproc 4                        # checks, launches

``python -m megatron_ring.train CONFIG`` is one rank (:func:`~megatron_ring.training.loop.train_main`,
as ``launch/train.py``); ``megatron-ring train`` (:func:`train_command`) validates the config for the
world it will launch, so a bad config stops before any rank starts (exit 2 naming the field), then
starts the ranks under torchrun (or ``--launcher deepspeed``) and returns their exit status. CONFIG
is a YAML with Megatron-LM's names (:mod:`megatron_ring.training.megatron_args`) or a DeepSpeed
training JSON.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

from megatron_ring.runtime.args import positive_int, usage_error


def train_command(argv: Optional[Sequence[str]] = None) -> int:
    """``megatron-ring train CONFIG [--nproc N] [--launcher torchrun|deepspeed]``: check, then launch."""
    from megatron_ring.check import layout_world
    from megatron_ring.config import ConfigError, load_mapping
    from megatron_ring.inference.compare import job_env, module_command
    from megatron_ring.training.schema import load_train_spec

    parser = argparse.ArgumentParser(prog="megatron-ring train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", type=Path, help="training YAML (Megatron-LM's names) or DeepSpeed training JSON")
    parser.add_argument("--nproc", type=positive_int, default=None,
                        help="processes (ranks) to start; default: the config's layout (a YAML: tp * pp * cp)")
    parser.add_argument("--launcher", choices=("torchrun", "deepspeed"), default="torchrun")
    args = parser.parse_args(argv)
    try:
        nproc = args.nproc or layout_world(load_mapping(args.config))
        spec = load_train_spec(args.config, world_size=nproc)
    except (ConfigError, OSError) as err:
        return usage_error(parser.prog, err)
    print(f"[megatron_ring] {args.config}: {spec.train.engine} engine, layout {spec.layout.describe()} on {nproc} "
          f"processes via {args.launcher}", flush=True)
    cmd = module_command("megatron_ring.train", [str(args.config)], nprocs=nproc, launcher=args.launcher)
    return subprocess.call(cmd, env=job_env())


if __name__ == "__main__":
    from megatron_ring.training.loop import train_main

    sys.exit(train_main())
