"""Where a real model's decode step goes under the hf runner: ring cp N vs AutoTP tp N, per step.

    python -m megatron_ring.perf.bench.decode_profile --prompt 2048 --steps 24 --out DIR

Both setups run the same checkpoint (SmolLM2-135M-Instruct by default) on ``N`` gloo ranks with
one thread each, prefill the same real prompt (the first tokens of a document), then decode
``--steps`` greedy tokens, each timed on every rank after a barrier (the slowest rank counts). One
step in the middle is profiled on rank 0 with ``torch.profiler``: its CPU time split into the
collectives (gloo all-gather / all-reduce / broadcast, waiting included), the linear layers,
attention, and the rest (norms, RoPE, embedding, and Python between ops: the step's wall time
minus the ops). Prints a table and writes ``decode_profile.json``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from megatron_ring.config import output_problem
from megatron_ring.inference import perplexity
from megatron_ring.perf.report import fmt_time, print_table
from megatron_ring.runtime.args import positive_int, usage_error
from megatron_ring.runtime.job import Interrupted, interruptible
from megatron_ring.runtime.reporting import write_json_atomic

SMOLLM2 = dict(zip(("checkpoint", "gguf_file"), perplexity.SMOLLM2))
"""The hf runner's model config of the default checkpoint (the one ``megatron-ring perplexity`` scores)."""
KINDS: dict[str, tuple[str, ...]] = {
    "collectives": ("gloo:", "c10d::", "all_gather", "allgather", "all_reduce", "allreduce", "broadcast", "wait",
                    "RowParallel"),
    "linear layers": ("aten::addmm", "aten::mm", "aten::linear", "aten::matmul", "aten::bmm"),
    "attention": ("scaled_dot_product", "_flash_attention", "megatron_ring::"),
}
"""Profiler op names (substrings, first match wins) of each part of a step; the rest is "other ops".
DeepSpeed AutoTP's ``RowParallel`` range holds its all-reduce (its linear is an ``aten::mm`` of its own)."""


def _kind(name: str) -> str:
    for kind, needles in KINDS.items():
        if any(needle in name for needle in needles):
            return kind
    return "other ops"


def step_breakdown(prof: Any, wall_s: float) -> tuple[dict[str, float], list[tuple[str, int, float]]]:
    """Seconds of one profiled step per kind (self CPU time of every op) and the Python rest; and the
    ten ops with the most self time (name, calls, seconds)."""
    parts = {kind: 0.0 for kind in (*KINDS, "other ops")}
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    for event in events:
        parts[_kind(event.key)] += event.self_cpu_time_total / 1e6
    parts["python and framework"] = max(0.0, wall_s - sum(parts.values()))
    return parts, [(e.key, e.count, e.self_cpu_time_total / 1e6) for e in events[:10]]


def rank_decode(model: dict[str, Any], tp: int, cp: int, ids: torch.Tensor, steps: int) -> dict[str, Any]:
    """On every rank of a ``tp * cp`` gloo world: prefill ``ids`` ``[1, L]``, decode ``steps`` tokens."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from megatron_ring import ParallelLayout, init_parallel
    from megatron_ring.inference.runners.hf import build_runner

    groups = init_parallel(ParallelLayout(tp=tp, cp=cp))
    runner = build_runner(model, groups, dtype=torch.float32, device=torch.device("cpu"), seed=0, batch=1,
                          prompt_len=ids.shape[1], new_tokens=steps + 1)
    runner.init_deepspeed({"dtype": "fp32", "replace_with_kernel_inject": False, "tensor_parallel": {"tp_size": tp}})
    runner.reset()
    dist.barrier()
    start = time.perf_counter()
    token = runner.prefill(ids)
    prefill_s = time.perf_counter() - start
    times, breakdown, top = [], {}, []
    for step in range(steps):
        dist.barrier()
        start = time.perf_counter()
        if step == steps // 2:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                token = runner.decode(token)
            wall = time.perf_counter() - start
            breakdown, top = step_breakdown(prof, wall)
        else:
            token = runner.decode(token)
        times.append(time.perf_counter() - start)
    return {"prefill_s": prefill_s, "step_s": times, "profiled_step": breakdown, "top_ops": top,
            "last_token": int(token[0])}


def _row(name: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    steps = [max(r["step_s"][i] for r in ranks) for i in range(len(ranks[0]["step_s"]))]
    return {"setup": name, "prefill_s": max(r["prefill_s"] for r in ranks), "tpot_median_s": statistics.median(steps),
            "tpot_s": steps, "profiled_step_rank0": ranks[0]["profiled_step"], "top_ops_rank0": ranks[0]["top_ops"],
            "same_tokens_on_every_rank": len({r["last_token"] for r in ranks}) == 1}


def decode_profile_main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_ring.perf.bench.decode_profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--document", default="data/corpus/GPL-3.txt", help="a text file (its first tokens are the prompt)")
    parser.add_argument("--prompt", type=positive_int, default=2048, help="prompt tokens")
    parser.add_argument("--steps", type=positive_int, default=24, help="decode steps timed")
    parser.add_argument("--size", type=positive_int, default=2, help="N: ring cp N and AutoTP tp N")
    parser.add_argument("--out", default="results/decode_profile", help="folder of decode_profile.json")
    args = parser.parse_args(argv)
    problem = output_problem({"--out": (args.out, True)})
    if problem is not None:
        return usage_error(parser.prog, problem)
    from megatron_ring.perf.bench.harness import machine_description
    from megatron_ring.runtime.pool import run_gloo

    try:
        ids, _ = perplexity.document_ids(SMOLLM2, [Path(args.document)], args.prompt)
    except (ValueError, OSError) as err:
        return usage_error(parser.prog, err)
    machine = machine_description()
    rows = []
    try:
        with interruptible():
            for name, tp, cp in ((f"ring cp {args.size}", 1, args.size), (f"AutoTP tp {args.size}", args.size, 1)):
                rows.append(_row(name, run_gloo(rank_decode, tp * cp, SMOLLM2, tp, cp, ids, args.steps,
                                                timeout_s=1800)))
    except Interrupted as stop:
        print(f"[decode_profile] {stop}: the ranks were stopped; nothing written", file=sys.stderr)
        return stop.exit_code
    kinds = list(rows[0]["profiled_step_rank0"])
    print_table(f"decode of SmolLM2-135M-Instruct, prompt {args.prompt} tokens, {args.size} ranks x 1 thread "
                f"(load {machine['loadavg_1_5_15'][0]:.1f})",
                ["setup", "prefill", "TPOT (median)", *[f"{k} (rank 0)" for k in kinds]],
                [[r["setup"], fmt_time(r["prefill_s"]), fmt_time(r["tpot_median_s"]),
                  *[fmt_time(r["profiled_step_rank0"][k]) for k in kinds]] for r in rows])
    path = write_json_atomic(Path(args.out) / "decode_profile.json",
                             {"machine": machine, "loadavg_after": list(os.getloadavg()), "argv": list(argv or []),
                              "prompt_tokens": args.prompt, "steps": args.steps, "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(decode_profile_main(sys.argv[1:]))
