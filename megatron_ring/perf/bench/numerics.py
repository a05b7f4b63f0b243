"""``megatron-ring bench numerics``: relative error of ring attention against float64, by ring size and dtype.

For each ring size ``P`` one gloo world of ``P`` processes runs ``ring_attention`` (p2p, zigzag)
on inputs drawn once in float64 and rounded to the dtype under test; the reference is
:func:`megatron_ring.attention.reference.attention_reference` in float64 on the *same rounded*
inputs, so the table shows the error the algorithm adds (block kernel, fp32 log-sum-exp merge,
the cast of the result), not the rounding of the inputs. Errors are ``||x - ref|| / ||ref||`` over
the whole gathered output and over the gathered gradients dQ, dK, dV (from the same upstream
gradient). ``L`` is fixed across ``P`` (it must be divisible by ``2 * max(P)``), so a column shows
how the error moves with the number of merged partial results alone.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from megatron_ring.perf.bench.harness import CAUSAL, DTYPES, borrow_pool
from megatron_ring.perf.report import markdown_table, print_table
from megatron_ring.config import output_problem
from megatron_ring.runtime.args import non_negative_int, positive_int, usage_error


def _global_inputs(cfg: dict[str, Any]) -> list[torch.Tensor]:
    """q, k, v, dout in float64, rounded through the dtype under test."""
    gen = torch.Generator().manual_seed(cfg["seed"])
    b, seq, h, hkv, d = cfg["batch"], cfg["L"], cfg["heads"], cfg["heads_kv"], cfg["head_dim"]
    shapes = [(b, seq, h, d), (b, seq, hkv, d), (b, seq, hkv, d), (b, seq, h, d)]
    dtype = DTYPES[cfg["dtype"]]
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype).to(torch.float64) for s in shapes]


def numerics_worker(cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """This rank's output and gradients (float64 copies) for the global inputs of ``cfg``."""
    from megatron_ring import ring_attention
    from megatron_ring.attention.sharding import shard_sequence

    rank, size = dist.get_rank(), dist.get_world_size()
    dtype = DTYPES[cfg["dtype"]]
    local = [shard_sequence(t, rank, size).to(dtype).contiguous() for t in _global_inputs(cfg)]
    q, k, v, dout = local
    for t in (q, k, v):
        t.requires_grad_(True)
    out = ring_attention(q, k, v, causal=cfg["causal"], backend=cfg["backend"])
    out.backward(dout)
    return {name: t.detach().to(torch.float64) for name, t in
            (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad))}


def reference(cfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Output and gradients in float64 on the global (rounded) inputs."""
    from megatron_ring.attention.reference import attention_reference

    q, k, v, dout = _global_inputs(cfg)
    for t in (q, k, v):
        t.requires_grad_(True)
    out = attention_reference(q, k, v, causal=cfg["causal"])
    out.backward(dout)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def run_numerics(*, ranks: list[int], dtypes: list[str], causals: list[bool], seq: int, batch: int, heads: int,
                 heads_kv: int, head_dim: int, backend: str, seed: int = 0, timeout_s: float = 300.0,
                 progress: Any = print, pools: Callable[[int, int], Any] | None = None) -> list[dict[str, Any]]:
    """Every (P, dtype, causal) point: relative errors of out, dq, dk, dv.

    ``pools(P, threads)`` may supply running gloo pools (see :func:`~megatron_ring.perf.bench.harness.borrow_pool`).
    """
    from megatron_ring.attention.sharding import unshard_sequence
    from megatron_ring.attention.reference import rel_err

    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        raise ValueError(f"dtype {bad} not allowed; allowed: {sorted(DTYPES)}")
    if seq < 1 or any(p < 1 for p in ranks):
        raise ValueError(f"L and every P must be >= 1, got L = {seq}, P {ranks}")
    for p in ranks:
        if seq % (2 * p):
            raise ValueError(f"L = {seq} must be divisible by 2*P for every P; P = {p} gives 2*P = {2 * p}")
    if heads % heads_kv:
        raise ValueError(f"heads ({heads}) must be a multiple of heads_kv ({heads_kv})")
    points = []
    refs: dict[tuple[str, bool], dict[str, torch.Tensor]] = {}
    for p in sorted(ranks):
        with borrow_pool(pools, p, 1, timeout_s) as pool:
            for dtype in dtypes:
                for causal in causals:
                    cfg = dict(P=p, dtype=dtype, causal=causal, L=seq, batch=batch, heads=heads, heads_kv=heads_kv,
                               head_dim=head_dim, backend=backend, seed=seed)
                    ref = refs.setdefault((dtype, causal), reference(cfg))
                    parts = pool.run(numerics_worker, cfg)
                    errs = {name: rel_err(unshard_sequence([r[name] for r in parts]), ref[name])
                            for name in ("out", "dq", "dk", "dv")}
                    points.append({k: cfg[k] for k in ("P", "dtype", "causal", "L", "batch", "heads", "heads_kv",
                                                       "head_dim", "backend")} | errs)
                    progress(f"P={p:2d} {dtype} causal={causal!s:5s} out {errs['out']:.2e} dq {errs['dq']:.2e} "
                             f"dk {errs['dk']:.2e} dv {errs['dv']:.2e}")
    return points


NUMERICS_COLUMNS = ["dtype", "P", "causal", "fwd rel err", "dq rel err", "dk rel err", "dv rel err"]


def numerics_rows(points: Sequence[dict[str, Any]]) -> list[list[str]]:
    """Rows of the numerics table."""
    return [[p["dtype"], p["P"], "yes" if p["causal"] else "no", f"{p['out']:.2e}", f"{p['dq']:.2e}",
             f"{p['dk']:.2e}", f"{p['dv']:.2e}"] for p in points]


def numerics_pivot(points: Sequence[dict[str, Any]]) -> str:
    """Markdown: one row per (dtype, causal, quantity), one column per ring size P."""
    ranks = sorted({p["P"] for p in points})
    cells = {(p["dtype"], p["causal"], p["P"]): p for p in points}
    rows = []
    for dtype in dict.fromkeys(p["dtype"] for p in points):
        for causal in (True, False):
            if not any((dtype, causal, r) in cells for r in ranks):
                continue
            for key, name in (("out", "out"), ("grads", "max(dq, dk, dv)")):
                vals = []
                for r in ranks:
                    p = cells.get((dtype, causal, r))
                    if p is None:
                        vals.append("-")
                        continue
                    v = p["out"] if key == "out" else max(p["dq"], p["dk"], p["dv"])
                    vals.append(f"{v:.2e}")
                rows.append([dtype, "yes" if causal else "no", name] + vals)
    return markdown_table(["dtype", "causal", "rel err of"] + [f"P={r}" for r in ranks], rows)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="megatron-ring bench numerics", description=__doc__.split("\n")[0])
    ap.add_argument("--P", dest="ranks", type=positive_int, nargs="+", default=[1, 2, 4, 8, 16],
                    help="ring sizes (processes)")
    ap.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--causal", choices=list(CAUSAL), default="both")
    ap.add_argument("--L", dest="seq", type=positive_int, default=512,
                    help="global sequence length, divisible by 2*max(P)")
    ap.add_argument("--batch", type=positive_int, default=2)
    ap.add_argument("--heads", type=positive_int, default=4)
    ap.add_argument("--heads-kv", type=non_negative_int, default=0, help="K/V heads (default 0 = heads)")
    ap.add_argument("--head-dim", type=positive_int, default=32)
    ap.add_argument("--backend", default="auto", help="ring block backend (auto, math, sdpa, flash_attn)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/bench_numerics.json")
    ap.add_argument("--markdown", help="also write the table as Markdown to this file")
    return ap


def bench_numerics_main(argv: list[str] | None = None) -> int:
    """``megatron-ring bench numerics``: run, write JSON (and Markdown), print the table."""
    parser = _parser()
    args = parser.parse_args(argv)
    problem = output_problem({"--out": (args.out, False), "--markdown": (args.markdown, False)})
    if problem is not None:
        return usage_error(parser.prog, problem)
    causals = CAUSAL[args.causal]
    try:
        points = run_numerics(ranks=args.ranks, dtypes=args.dtype, causals=causals, seq=args.seq, batch=args.batch,
                              heads=args.heads, heads_kv=args.heads_kv or args.heads, head_dim=args.head_dim,
                              backend=args.backend, seed=args.seed)
    except ValueError as err:
        return usage_error(parser.prog, err)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"argv": argv if argv is not None else [], "points": points}, indent=2))
    rows = numerics_rows(points)
    print_table(f"relative error vs float64 (L={args.seq}, batch {args.batch}, heads {args.heads}, "
                       f"head_dim {args.head_dim})", NUMERICS_COLUMNS, rows)
    if args.markdown:
        Path(args.markdown).write_text(numerics_pivot(points) + "\n\n" + markdown_table(NUMERICS_COLUMNS, rows) + "\n")
    print(f"wrote {out}")
    return 0
