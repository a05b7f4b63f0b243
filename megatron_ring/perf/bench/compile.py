"""``megatron-ring bench compile``: an attention layer with the ring, eager vs ``torch.compile``.

Every point runs on ``P`` gloo processes (CPU), ``threads = max(1, cores // P)`` each. The layer is
what a transformer block does around its attention, ``x [batch, seq_local, hidden]``::

    y = x + o_proj(ring_attention(rope-free q/k/v of norm(x), causal, GQA))

so inductor has code to fuse around the ring's custom op (the op itself stays opaque: Note
[torch.compile] in attention/ops.py). ``decode`` times one decode step of the same layer: one new
token's q/k/v projections, append to this rank's cache shard (it grows every step; the compiled
step marks it dynamic), ``decode_attention``, output projection.

Eager and compiled run interleaved (repeat r runs each once, in turn) after warm-up calls, the
compiled ones after compiling; per point the median / min / max over ``repeats`` of the slowest
rank's wall time, and the compile time (the first call, slowest rank).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_ring.attention.decode import decode_attention
from megatron_ring.attention.api import ring_attention
from megatron_ring.perf.bench.harness import barrier_timed, slowest
from megatron_ring.config import output_problem
from megatron_ring.runtime.args import positive_int, usage_error
from megatron_ring.runtime.pool import GlooPool

MODES: tuple[str, ...] = ("fwd", "fwd_bwd", "decode")


class AttentionLayer(torch.nn.Module):
    """Pre-norm attention block with ring attention over the CP group (``heads_kv`` K/V heads)."""

    def __init__(self, hidden: int, heads: int, heads_kv: int) -> None:
        super().__init__()
        self.heads, self.heads_kv, self.head_dim = heads, heads_kv, hidden // heads
        self.norm = torch.nn.RMSNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, (heads + 2 * heads_kv) * self.head_dim, bias=False)
        self.out = torch.nn.Linear(heads * self.head_dim, hidden, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[b, s, heads, d]``, k/v ``[b, s, heads_kv, d]`` of ``x [b, s, hidden]``."""
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).split([self.heads * self.head_dim, self.heads_kv * self.head_dim,
                                                self.heads_kv * self.head_dim], dim=-1)
        return (q.view(b, s, self.heads, self.head_dim), k.view(b, s, self.heads_kv, self.head_dim),
                v.view(b, s, self.heads_kv, self.head_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project(x)
        return x + self.out(ring_attention(q, k, v, causal=True).flatten(2))

    def decode_step(self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    keep: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token ``x [b, 1, hidden]`` against this rank's shard; ``keep``: the shard gains its K/V."""
        q, k, v = self.project(x)
        if keep:
            k_cache, v_cache = torch.cat([k_cache, k], 1), torch.cat([v_cache, v], 1)
        return x + self.out(decode_attention(q, k_cache, v_cache).flatten(2)), k_cache, v_cache


def _point(mode: str, seq: int, batch: int, hidden: int, heads: int, heads_kv: int, repeats: int,
           warmup: int) -> dict[str, Any]:
    """This rank's times for one point: ``{"eager": [..], "compiled": [..], "compile_s": ..}``."""
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    layer = AttentionLayer(hidden, heads, heads_kv)
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(rank)
    if mode == "decode":
        head_dim = hidden // heads
        k0 = torch.randn(batch, seq // size, heads_kv, head_dim, generator=gen)
        v0 = torch.randn(batch, seq // size, heads_kv, head_dim, generator=gen)
        token = torch.randn(batch, 1, hidden)
        compiled_step = torch.compile(layer.decode_step)
        state = {"eager": [k0, v0, 0], "compiled": [k0, v0, 0]}

        def run(name: str) -> Callable[[], Any]:
            def step() -> None:
                k, v, n = state[name]
                fn = layer.decode_step if name == "eager" else compiled_step
                if name == "compiled":
                    torch._dynamo.maybe_mark_dynamic(k, 1)
                    torch._dynamo.maybe_mark_dynamic(v, 1)
                with torch.no_grad():
                    _, k, v = fn(token, k, v, n % size == rank)
                state[name] = [k, v, n + 1]
            return step
    else:
        x = torch.randn(batch, seq // size, hidden, generator=gen)
        compiled_layer = torch.compile(layer)

        def run(name: str) -> Callable[[], Any]:
            module = layer if name == "eager" else compiled_layer

            def call() -> None:
                if mode == "fwd":
                    with torch.no_grad():
                        module(x)
                else:
                    module(x.requires_grad_()).sum().backward()
            return call
    calls = {name: run(name) for name in ("eager", "compiled")}
    compile_s = barrier_timed(calls["compiled"])
    for _ in range(warmup):
        for call in calls.values():
            call()
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for _ in range(repeats):
        for name, call in calls.items():
            times[name].append(barrier_timed(call))
    return {**times, "compile_s": compile_s}


def run_bench(*, ranks: int, modes: list[str], seqs: list[int], batch: int, hidden: int, heads: int, heads_kv: int,
              repeats: int, warmup: int) -> list[dict[str, Any]]:
    """Every (mode, seq) point on one pool of ``ranks`` gloo processes; one row each."""
    for seq in seqs:
        if seq % (2 * ranks):
            raise ValueError(f"--seq {seq} must be a multiple of 2 x ranks = {2 * ranks} (zigzag sharding)")
    if hidden % heads or heads % heads_kv:
        raise ValueError(f"--hidden {hidden} must divide by --heads {heads}, which must divide by --heads-kv {heads_kv}")
    threads = max(1, (os.cpu_count() or 1) // ranks)
    points = []
    with GlooPool(ranks, timeout_s=900, threads=threads) as pool:
        for mode in modes:
            for seq in seqs:
                per_rank = pool.run(_point, mode, seq, batch, hidden, heads, heads_kv, repeats, warmup)
                times_of = {name: slowest([r[name] for r in per_rank]) for name in ("eager", "compiled")}
                row: dict[str, Any] = {"mode": mode, "seq": seq, "batch": batch, "hidden": hidden, "heads": heads,
                                       "heads_kv": heads_kv, "ranks": ranks, "threads": threads,
                                       "compile_s": max(r["compile_s"] for r in per_rank)}
                for name, times in times_of.items():
                    row[name] = {"median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times),
                                 "max_ms": 1e3 * max(times)}
                row["speedup"] = row["eager"]["median_ms"] / row["compiled"]["median_ms"]
                points.append(row)
    return points


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-ring bench compile", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=positive_int, default=2)
    p.add_argument("--mode", choices=MODES, nargs="+", default=list(MODES))
    p.add_argument("--seq", type=positive_int, nargs="+", default=[1024, 4096],
                   help="global sequence length (decode: the cache length before the timed steps)")
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--hidden", type=positive_int, default=512)
    p.add_argument("--heads", type=positive_int, default=8)
    p.add_argument("--heads-kv", type=positive_int, default=2)
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--warmup", type=positive_int, default=2)
    p.add_argument("--out", default="results/bench_compile.json")
    return p


def bench_compile_main(argv: list[str] | None = None) -> int:
    """``megatron-ring bench compile``: run, write JSON, print the table."""
    parser = _parser()
    args = parser.parse_args(argv)
    problem = output_problem({"--out": (args.out, False)})
    if problem is not None:
        return usage_error(parser.prog, problem)
    try:
        points = run_bench(ranks=args.ranks, modes=args.mode, seqs=args.seq, batch=args.batch, hidden=args.hidden,
                           heads=args.heads, heads_kv=args.heads_kv, repeats=args.repeats, warmup=args.warmup)
    except ValueError as err:
        return usage_error(parser.prog, err)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"argv": argv if argv is not None else [], "torch": torch.__version__,
                               "load_average": os.getloadavg(), "points": points}, indent=2))
    print(f"{'mode':8} {'seq':>6} {'eager ms':>16} {'compiled ms':>16} {'speedup':>8} {'compile s':>10}")
    for row in points:
        e, c = row["eager"], row["compiled"]
        print(f"{row['mode']:8} {row['seq']:>6} {e['median_ms']:>8.2f} ({e['min_ms']:.2f}) "
              f"{c['median_ms']:>8.2f} ({c['min_ms']:.2f}) {row['speedup']:>8.2f} {row['compile_s']:>10.1f}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(bench_compile_main())
