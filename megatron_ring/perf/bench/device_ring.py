"""The two-rank check of the prepared device check: a real ring between two processes.

On a GPU both ranks share the one device over NCCL, in NCCL's multi-rank-per-GPU mode (NCCL >=
2.30, ``NCCL_MULTI_RANK_GPU_ENABLE=1``; its docs advise limiting channels, ``NCCL_MAX_CTAS``, and
``NCCL_NVLS_ENABLE=0``); with an older NCCL the check says so and skips. ``--cpu-dry-run`` runs
the same code over gloo on two CPU processes. Each rank runs ``ring_attention`` with every comm
and ``decode_attention`` against float64, then one profiled forward+backward of the p2p ring:
the share of NCCL kernel time that runs while another kernel runs tells whether the transfers
overlap the attention kernels.
"""
from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_ring import ParallelLayout, decode_attention, init_parallel, ring_attention, shard_sequence
from megatron_ring.attention.comms import COMMS
from megatron_ring.attention.reference import attention_reference, rel_err
from megatron_ring.runtime.pool import free_port

NCCL_ENV = {"NCCL_MULTI_RANK_GPU_ENABLE": "1", "NCCL_MAX_CTAS": "8", "NCCL_NVLS_ENABLE": "0"}
MIN_NCCL = (2, 30, 0)


def nccl_problem() -> str | None:
    """Why two NCCL ranks cannot share this machine's GPU, or None."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    version = tuple(torch.cuda.nccl.version())
    if version < MIN_NCCL:
        return f"NCCL {'.'.join(map(str, version))} < 2.30: no multi-rank-per-GPU mode"
    return None


def _rank_main(rank: int, port: int, backend: str, seq: int, trace_seq: int, out_dir: str, results: Any) -> None:
    os.environ.update(NCCL_ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=2, timeout=timedelta(seconds=120))
    try:
        rows = _exactness(rank, device, seq) + _overlap(rank, device, trace_seq, Path(out_dir))
        results.put((rank, rows, None))
    except Exception as err:  # reported by the parent, which must not wait for a dead rank
        results.put((rank, [], f"{type(err).__name__}: {err}"))
    finally:
        dist.destroy_process_group()


def _row(case: str, metric: str, value: float, target: str | None, ok: bool | None) -> dict[str, Any]:
    return {"check": "two_rank_ring", "case": case, "metric": metric, "value": value, "target": target, "ok": ok}


def _exactness(rank: int, device: torch.device, seq: int) -> list[dict[str, Any]]:
    """Every comm and decode at cp 2, bf16, vs float64; gradients too."""
    rows = []
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(1, seq, h, 32, generator=gen) for h in (4, 2, 2, 4))
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = attention_reference(*leaves, causal=True)
    expected = [ref, *torch.autograd.grad(ref, leaves, dout.double())]
    groups = init_parallel(ParallelLayout(cp=2, cp_a2a=2)).cp_groups
    for comm in COMMS:
        local = [shard_sequence(t, rank, 2).to(device, torch.bfloat16).requires_grad_() for t in (q, k, v)]
        out = ring_attention(*local, groups, causal=True, comm=comm)
        out.backward(shard_sequence(dout, rank, 2).to(device, torch.bfloat16))
        got = [out, *(t.grad for t in local)]
        worst = max(rel_err(g.cpu(), shard_sequence(e, rank, 2)) for g, e in zip(got, expected))
        rows.append(_row(f"{comm} bf16 causal cp=2", "max rel. err (out, dq, dk, dv) vs float64", worst, "<= 1e-2",
                         worst <= 1e-2))
    cache = [t[:, rank::2].to(device, torch.bfloat16) for t in (k, v)]  # a round-robin cache shard
    new = q[:, -1:].to(device, torch.bfloat16)
    got = decode_attention(new, *cache, groups)
    want = attention_reference(q[:, -1:], k, v)
    err = rel_err(got.cpu(), want)
    rows.append(_row("decode bf16 cp=2", "rel. err vs float64", err, "<= 1e-2", err <= 1e-2))
    return rows


def _overlap(rank: int, device: torch.device, seq: int, out_dir: Path) -> list[dict[str, Any]]:
    """One profiled p2p forward+backward; the share of NCCL kernel time concurrent with other kernels."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    q, k, v = (torch.randn(1, seq // 2, h, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
               for h in (8, 2, 2))
    ring_attention(q, k, v, causal=True).sum().backward()  # warm-up
    with torch.profiler.profile(activities=activities) as prof:
        ring_attention(q, k, v, causal=True).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    if rank == 0:
        prof.export_chrome_trace(str(out_dir / "two_rank_trace.json"))
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    nccl = [(a, b) for name, a, b in kernels if "nccl" in name.lower()]
    other = [(a, b) for name, a, b in kernels if "nccl" not in name.lower()]
    total = sum(b - a for a, b in nccl)
    hidden = sum(max(0, min(b, d) - max(a, c)) for a, b in nccl for c, d in other)
    share = min(1.0, hidden / total) if total else float("nan")
    case = f"p2p fwd+bwd bf16 L={seq} ({len(nccl)} NCCL kernels, {len(other)} others)"
    return [_row(case, "NCCL kernel time concurrent with other kernels", share, "> 0 (transfers overlap)",
                 share > 0 if total else None)]


def two_rank_ring(dry_run: bool, seq: int, trace_seq: int, out_dir: Path) -> list[dict[str, Any]]:
    """Rows of both ranks (rank 0's, which equal rank 1's in kind), or one row saying why it skipped."""
    problem = None if dry_run else nccl_problem()
    if problem is not None:
        return [_row("skipped", problem, float("nan"), None, None)]
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, "gloo" if dry_run else "nccl", seq, trace_seq,
                                                  str(out_dir), results)) for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        outcomes = dict((rank, (rows, error)) for rank, rows, error in (results.get(timeout=300) for _ in procs))
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    errors = [f"rank {r}: {e}" for r, (_, e) in sorted(outcomes.items()) if e]
    if errors:
        return [_row("failed", "; ".join(errors), float("nan"), None, False)]
    return outcomes[0][0] + [dict(r, case=f"rank 1: {r['case']}") for r in outcomes[1][0] if r["ok"] is False]
