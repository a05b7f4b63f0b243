"""``megatron-ring``: inspect layouts, run the ring demo, train, plan, calibrate, benchmark and compare setups.

Subcommands that need optional frameworks import them only when called. Delegated subcommands
(``plan``, ``bench attention`` ...) parse their own flags, ``--help`` included; a bad value exits
with status 2 and one ``megatron-ring <command>: error: ...`` line, never a traceback.
"""
from __future__ import annotations

import argparse
import importlib
import os
import shutil
import subprocess
import sys
from typing import Callable, Sequence

from megatron_ring.runtime.args import positive_int, usage_error
from megatron_ring.demo import add_demo_arguments, check_demo_args, demo_argv
from megatron_ring.parallel.layout import AXES, HIERARCHICAL_LEVELS, ParallelLayout

# name -> (module, function, help): each takes its own argv (--help included) and returns an exit code
DELEGATED: dict[str, tuple[str, str, str]] = {
    "plan": ("megatron_ring.perf.planner.plan_cli", "plan_main", "analytical model of a config on a hardware profile"),
    "calibrate": ("megatron_ring.perf.planner.calibrate", "calibrate_main",
                  "measure this machine (CPU ranks, gloo) and write a hardware profile for the planner"),
    "compare": ("megatron_ring.inference.compare", "compare_main",
                "run the baseline and ring configs of a pair under the deepspeed launcher, side by side"),
    "sweep": ("megatron_ring.perf.sweep.cli", "sweep_main",
              "baseline vs ring of a pair over prompt lengths (and batches), repeated: sweep.json and plots"),
    "perplexity": ("megatron_ring.inference.perplexity", "perplexity_main",
                   "a document's perplexity under the ring at several CP sizes and under DeepSpeed AutoTP"),
    "infer": ("megatron_ring.inference.main", "infer_main",
              "one inference run of a deepspeed JSON config in this process group (what launch/infer.py runs)"),
    "export": ("megatron_ring.training.export", "export_main",
               "write a transformers checkpoint (safetensors, config, tokenizer) from a training checkpoint"),
    "train": ("megatron_ring.train", "train_command",
              "train (engine megatron: a YAML with Megatron-LM's names, or a training JSON): checked, then torchrun"),
    "check": ("megatron_ring.check", "check_main",
              "validate training, inference and model configs without starting a rank (exit 2 naming the field)"),
    "needle-data": ("megatron_ring.training.needle_data", "needle_data_main",
                    "long-document question/answer JSONL (a fact hidden in local text) for fine-tuning and evaluation"),
    "lm-eval": ("megatron_ring.eval.harness_cli", "harness_cli_main",
                "lm-evaluation-harness with the model megatron_ring over the ring (checked, then launched)"),
    "serve": ("megatron_ring.serving.serve_cli", "serve_cli_main",
              "an OpenAI-compatible HTTP server of an inference config's model over its ranks (chat, streaming, "
              "follow-up turns from the sharded cache)"),
    "niah": ("megatron_ring.eval.niah", "niah_main",
             "needle in a haystack over lengths x depths for any inference config: niah.json and the heatmap"),
}
BENCHES: dict[str, tuple[str, str, str]] = {
    "attention": ("megatron_ring.perf.bench.attention", "bench_attention_main",
                  "ring (p2p) vs all-gather vs single process vs DeepSpeed Ulysses on gloo ranks"),
    "numerics": ("megatron_ring.perf.bench.numerics", "bench_numerics_main",
                 "relative error of ring attention against float64, by ring size and dtype"),
    "compile": ("megatron_ring.perf.bench.compile", "bench_compile_main",
                "an attention layer with the ring (prefill, training step, decode step), eager vs torch.compile"),
    "train-memory": ("megatron_ring.perf.bench.train_memory", "bench_train_memory_main",
                     "the longest sequence a Megatron GPT trains under a fixed memory cap per process, by cp"),
}


def _shown(groups: list[list[int]], most: int = 4, members: int = 16) -> str:
    """The first ``most`` groups, each cut after ``members`` ranks, and how many there are."""
    def one(group: list[int]) -> str:
        head = ", ".join(map(str, group[:members]))
        return str(group) if len(group) <= members else f"[{head}, ... ({len(group)} ranks)]"

    return ", ".join(one(g) for g in groups[:most]) + (f", ... ({len(groups)} groups)" if len(groups) > most else "")


def _layout_table(layout: ParallelLayout) -> str:
    """The rank grid, each rank's cp ring neighbours and the first groups of each axis (linear in the world)."""
    lines = [f"layout {layout.describe()}  (rank order tp-cp-dp-pp, Megatron's tp-cp-ep-dp-pp)", ""]
    lines.append(f"{'rank':>5} " + " ".join(f"{a:>3}" for a in AXES) + "   cp ring (prev -> rank -> next)")
    for rank in range(layout.world_size):
        coords = layout.coords(rank)
        prev, nxt = layout.ring_neighbours(rank, "cp")
        lines.append(f"{rank:>5} " + " ".join(f"{coords[a]:>3}" for a in AXES)
                     + f"   {prev:>3} -> {rank:>3} -> {nxt:>3}")
    lines.append("")
    for axis in AXES + ("dp-cp",):
        lines.append(f"{axis:>6} groups: {_shown(layout.groups(axis))}")
    if layout.cp_a2a is not None:
        for level in HIERARCHICAL_LEVELS:
            lines.append(f"{level:>7} groups: {_shown(layout.hierarchical_groups(level))}")
        lines.append("  (a2a+p2p: all-to-all inside each cp-a2a group, keep it within a node; the ring across "
                     "cp-ring groups)")
    return "\n".join(lines)


def _cmd_layout(args: argparse.Namespace) -> int:
    from megatron_ring.config.layout import LayoutConfig

    sizes = {axis: getattr(args, axis) for axis in AXES} | ({"cp_a2a": args.cp_a2a} if args.cp_a2a else {})
    layout = LayoutConfig.parse(sizes, where="the layout flags").layout()
    if args.world is not None:
        layout.check_world_size(args.world)
    print(_layout_table(layout))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    check_demo_args(args, args.nproc)
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if torchrun is None:
        raise SystemExit("torchrun not found on PATH (it ships with torch)")
    cmd = [torchrun, "--standalone", f"--nproc_per_node={args.nproc}", "-m", "megatron_ring.demo", *demo_argv(args)]
    print("+ " + " ".join(cmd), flush=True)
    return subprocess.call(cmd)


def _delegate(module: str, func: str) -> Callable[[Sequence[str]], int]:
    def run(argv: Sequence[str]) -> int:
        return int(getattr(importlib.import_module(module), func)(list(argv)) or 0)
    return run


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="megatron-ring", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("layout", help="print the rank grid and groups of a parallel layout")
    for axis in AXES:
        p.add_argument(f"--{axis}", type=positive_int, default=1, help=f"{axis} size")
    p.add_argument("--cp-a2a", type=positive_int, default=None,
                   help="hierarchical CP (a2a+p2p): all-to-all group size, a divisor of --cp")
    p.add_argument("--world", type=positive_int, default=None, help="check against this many launched ranks")
    p.set_defaults(handler=_cmd_layout)

    p = sub.add_parser("demo", help="ring attention on N CPU processes (torchrun, gloo) checked against float64")
    p.add_argument("--nproc", type=positive_int, default=4, help="ranks (CPU processes, or GPUs)")
    add_demo_arguments(p)
    p.set_defaults(handler=_cmd_demo)

    for name, (module, func, text) in DELEGATED.items():
        sub.add_parser(name, help=text, add_help=False).set_defaults(delegate=_delegate(module, func))
    benches = sub.add_parser("bench", help="benchmarks: " + ", ".join(BENCHES)).add_subparsers(
        dest="bench", required=True)
    for name, (module, func, text) in BENCHES.items():
        benches.add_parser(name, help=text, add_help=False).set_defaults(delegate=_delegate(module, func))

    args, rest = parser.parse_known_args(argv)
    if hasattr(args, "delegate"):
        return args.delegate(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return args.handler(args)
    except (ValueError, TypeError) as err:  # ConfigError included
        return usage_error(f"megatron-ring {args.command}", err)


if __name__ == "__main__":
    sys.exit(main())
