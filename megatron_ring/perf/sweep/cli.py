"""``megatron-ring sweep``: the baseline and the ring config of a pair over prompt lengths (and batches).

Every (batch, prompt length) point gets a derived config of each side (``OUT/configs``, the
workload overridden, the model path made absolute), validated like any run before the first launch.
Then, point by point, each repeat runs the baseline and then the ring config under a real launcher
(:func:`~megatron_ring.inference.compare.run_config`), so slow drift of the machine hits both sides
alike. Outputs, all under ``OUT``::

    runs/<config>_L<len>_b<batch>_r<rep>.json   each run's result (and .log)
    sweep.json                                  per point: median/min/max per side, ring/baseline ratios,
                                                crossovers, provenance (schema: SweepResult)
    sweep_ratios.png, sweep_latency.png, sweep_memory.png

    megatron-ring sweep cpu --lengths 16 32 48 --repeats 1
    megatron-ring sweep A.json B.json --lengths 1024 4096 16384 --batches 1 4 --out-dir results/sweep
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Sequence

from megatron_ring.config import ConfigError, output_problem
from megatron_ring.inference import compare
from megatron_ring.perf.planner.predict import make_predictor
from megatron_ring.perf.sweep.run import STAGING, repredict, run_sweep
from megatron_ring.perf.sweep.table import format_sweep_table
from megatron_ring.runtime.args import positive_int, usage_error
from megatron_ring.runtime.folder_lock import FolderBusy, owned_folder
from megatron_ring.runtime.job import Interrupted, interruptible


def sweep_main(argv: Sequence[str] | None = None) -> int:
    """Entry of ``megatron-ring sweep``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="megatron-ring sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", nargs="*", metavar="PAIR|CONFIG",
                        help=f"a pair name ({', '.join(sorted(compare.PAIRS))}) or baseline and ring config paths")
    parser.add_argument("--lengths", type=positive_int, nargs="+", help="prompt lengths (required unless --replot)")
    parser.add_argument("--batches", type=positive_int, nargs="+", default=None,
                        help="batch sizes (default: the configs' own)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="runs of each side per point")
    parser.add_argument("--new-tokens", type=positive_int, default=None, help="override the configs' new_tokens")
    parser.add_argument("--out-dir", default="results/sweep", help="where configs, runs, sweep.json and plots go")
    parser.add_argument("--launcher", choices=["deepspeed", "torchrun"], default="deepspeed")
    parser.add_argument("--settle", type=float, default=0.0, metavar="SECONDS",
                        help="first wait up to this long for the load average to fall to half the cores")
    parser.add_argument("--predict", metavar="PROFILE", default=None,
                        help="also predict every point with the planner on this hardware profile (a bundled name "
                             "or a JSON, e.g. one written by megatron-ring calibrate) and store the errors")
    parser.add_argument("--replot", metavar="DIR", default=None,
                        help="run nothing: recompute a stored sweep's predictions (with --predict, else drop them), "
                             "errors and plots in DIR")
    args = parser.parse_args(argv)
    if args.replot:
        if args.configs or args.lengths:
            parser.error("--replot takes no pair and no --lengths: it reads DIR/sweep.json")
        try:
            summary = repredict(Path(args.replot), make_predictor(args.predict) if args.predict else None)
        except (ConfigError, OSError) as err:
            return usage_error(parser.prog, err)
        print(format_sweep_table(summary))
        return 0
    if not args.configs or not args.lengths:
        parser.error("give a pair (or two configs) and --lengths")
    problem = output_problem({"--out-dir": (args.out_dir, True)})
    if problem is not None:
        return usage_error(parser.prog, problem)
    out_dir = Path(args.out_dir)
    try:
        baseline, ring = compare.resolve_pair(args.configs)
        with owned_folder(out_dir, field="--out-dir"), interruptible():  # Note [Folder locks]
            summary = run_sweep(baseline, ring, lengths=args.lengths, batches=args.batches, repeats=args.repeats,
                                new_tokens=args.new_tokens, out_dir=out_dir, launcher=args.launcher,
                                predict=make_predictor(args.predict) if args.predict else None, settle_s=args.settle,
                                command=shlex.join(["megatron-ring", "sweep", *argv]))
    except (ConfigError, FolderBusy) as err:
        return usage_error(parser.prog, err)
    except RuntimeError as err:
        print(f"[sweep] {err}", file=sys.stderr)
        return 1
    except Interrupted as stop:
        print(f"[sweep] {stop}: the running job was stopped; {out_dir} keeps the last complete sweep (this one's "
              f"finished runs are in {out_dir / STAGING})", file=sys.stderr)
        return stop.exit_code
    print()
    print(format_sweep_table(summary))
    print(f"\n[sweep] {out_dir / 'sweep.json'} and plots written")
    return 0
