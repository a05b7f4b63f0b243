"""``megatron-ring bench attention``, the side of one gloo rank: build each implementation, time it, measure it.

:func:`bench_worker` runs every implementation of one point on this rank, interleaved (the driver,
:mod:`megatron_ring.perf.bench.attention`, says why), with the instrumentation of
:func:`megatron_ring.attention.transport.ring_stats` and the peak memory of
:func:`~megatron_ring.perf.bench.harness.measure_peak`.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_ring.attention.comms import A2A_COMMS, COMMS, Comm
from megatron_ring.perf.bench.harness import DTYPES, measure_peak, own_session, track_mmap

IMPL_COMM: dict[str, Comm] = {"single": "p2p", "ring_p2p": "p2p", **{c: c for c in COMMS if c != "p2p"}}
"""Our implementations and the comm each runs (``single``: ``ring_attention`` on one rank)."""
IMPLS: tuple[str, ...] = (*IMPL_COMM, "ulysses")
"""Ours, and DeepSpeed's Ulysses (``deepspeed.sequence.layer.DistributedAttention``)."""
RING_IMPLS: tuple[str, ...] = tuple(impl for impl, comm in IMPL_COMM.items() if comm not in A2A_COMMS)
"""The implementations that take a window and packed documents (the variants)."""
VARIANT_IMPLS: dict[str, tuple[str, ...]] = {"window": RING_IMPLS, "packed": RING_IMPLS, "separate": RING_IMPLS,
                                             "contiguous": ("a2a",), "dilated": RING_IMPLS}
MODES: tuple[str, ...] = ("fwd", "fwd_bwd")


def ulysses_available() -> bool:
    """Whether ``deepspeed.sequence.layer.DistributedAttention`` can be imported."""
    try:
        from deepspeed.sequence.layer import DistributedAttention  # noqa: F401
    except Exception:  # deepspeed missing, or failing to initialise its accelerator
        return False
    return True


def _solo_group() -> dist.ProcessGroup:
    """A group holding only rank 0, for the single-process baseline inside a P-rank pool (collective, cached)."""
    global _SOLO
    if _SOLO is None:
        _SOLO = dist.new_group([0])
    return _SOLO


_SOLO: dist.ProcessGroup | None = None


def _window_size(cfg: dict[str, Any]) -> tuple[int, int]:
    """``--window W`` as flash-attn's ``(left, right)``: ``(W, 0)`` causal, ``(W, W)`` otherwise."""
    w = cfg.get("window") or -1
    return (w, 0 if cfg["causal"] else w) if w > 0 else (-1, -1)


def _cu_seqlens(cfg: dict[str, Any]) -> torch.Tensor:
    """N equal documents of L/N tokens."""
    n = cfg["docs"]
    return torch.arange(0, cfg["L"] + 1, cfg["L"] // n, dtype=torch.int32)


def _make_attention(cfg: dict[str, Any]) -> Callable[..., torch.Tensor]:
    from megatron_ring import ring_attention

    impl, causal, backend = cfg["impl"], cfg["causal"], cfg["backend"]
    if impl in IMPL_COMM:
        comm = IMPL_COMM[impl]
        group: Any = _solo_group() if impl == "single" else None
        if impl == "a2a+p2p":
            from megatron_ring import ParallelLayout, init_parallel

            group = init_parallel(ParallelLayout(cp=dist.get_world_size(), cp_a2a=cfg.get("a2a_size", 2))).cp_groups
        window = _window_size(cfg)
        cu = _cu_seqlens(cfg) if cfg.get("variant") == "packed" else None
        dilation = cfg.get("dilation") if cfg.get("variant") == "dilated" else None

        sharding = _sharding(cfg)

        def ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return ring_attention(q, k, v, group, causal=causal, comm=comm, backend=backend, window_size=window,
                                  cu_seqlens=cu, sharding=sharding, dilation=dilation)
        if cfg.get("variant") == "separate":  # [docs, batch, seq_local, heads, dim]: one call per document
            return lambda q, k, v: torch.stack([ring(q[i], k[i], v[i]) for i in range(q.shape[0])])
        return ring
    import deepspeed.comm
    from deepspeed.sequence.layer import DistributedAttention

    if not deepspeed.comm.is_initialized():  # adopts the gloo group torch.distributed already has
        deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)

    def local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        groups = q.shape[2] // k.shape[2]
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, enable_gqa=groups > 1)
        return out.transpose(1, 2)

    dist_attn = DistributedAttention(local, dist.group.WORLD, scatter_idx=2, gather_idx=1)

    def ulysses(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return dist_attn(q, k, v, 0)
    return ulysses


def _sharding(cfg: dict[str, Any]) -> str:
    """How a point's inputs are sharded: contiguous for Ulysses and the ``contiguous`` variant, else zigzag."""
    return "contiguous" if cfg["impl"] == "ulysses" or cfg.get("variant") == "contiguous" else "zigzag"


def _inputs(cfg: dict[str, Any], rank: int, size: int, device: torch.device) -> list[torch.Tensor]:
    """This rank's q, k, v (and dout): one global tensor per name from a fixed seed, then sharded.

    The single-process baseline gets the global tensors (on rank 0; the other ranks idle).
    """
    from megatron_ring.attention.sharding import shard_sequence

    gen = torch.Generator().manual_seed(cfg["seed"])
    b, seq, h, hkv, d = cfg["batch"], cfg["L"], cfg["heads"], cfg["heads_kv"], cfg["head_dim"]
    shapes = [(b, seq, h, d), (b, seq, hkv, d), (b, seq, hkv, d), (b, seq, h, d)]
    sharding = _sharding(cfg)
    sharded = size > 1 and cfg["impl"] != "single"
    out = []
    for shape in shapes:
        full = torch.randn(shape, generator=gen)
        if cfg.get("variant") == "packed":  # [tokens, heads, dim]
            cu = _cu_seqlens(cfg)
            local = shard_sequence(full[0], rank, size, dim=0, cu_seqlens=cu) if sharded else full[0]
        elif cfg.get("variant") == "separate":  # [docs, batch, seq_local, heads, dim]
            docs = full.split(seq // cfg["docs"], dim=1)
            local = torch.stack([shard_sequence(d, rank, size) if sharded else d for d in docs])
        else:
            local = shard_sequence(full, rank, size, sharding=sharding) if sharded else full
        out.append(local.to(device=device, dtype=DTYPES[cfg["dtype"]]).contiguous())
    return out


class _Case:
    """One implementation of one point on this rank: inputs, the call, and what it measured."""

    def __init__(self, cfg: dict[str, Any], rank: int, size: int) -> None:
        self.cfg = cfg
        self.device = torch.device(cfg["device"])
        self.active = cfg["impl"] != "single" or rank == 0
        self.grad = cfg["mode"] == "fwd_bwd"
        self.attn = _make_attention(cfg)
        self.tensors = _inputs(cfg, rank, size, self.device) if self.active else []
        for t in self.tensors[:3]:
            t.requires_grad_(self.grad)
        self.times: list[float] = []
        self.wait = self.compute = self.total = 0.0
        self.sent = self.calls = 0

    def call(self) -> None:
        if not self.active:
            return
        q, k, v, dout = self.tensors
        out = self.attn(q, k, v)
        if self.grad:
            out.backward(dout)
            for t in (q, k, v):
                t.grad = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed(self) -> None:
        from megatron_ring.attention.transport import ring_stats

        with ring_stats() as stats:
            t0 = time.perf_counter()
            self.call()
            self.times.append(time.perf_counter() - t0)
        self.wait += stats.wait_s
        self.compute += stats.compute_s
        self.total += stats.total_s
        self.sent += stats.bytes_sent
        self.calls += stats.calls

    def result(self, peak: int) -> dict[str, Any]:
        return {"active": self.active, "times": self.times, "wait_s": self.wait, "compute_s": self.compute,
                "ring_total_s": self.total, "bytes_sent": self.sent / len(self.times) if self.calls else None,
                "peak_mem_bytes": peak}


def bench_worker(cfgs: list[dict[str, Any]], repeats: int, warmup: int) -> list[dict[str, Any]]:
    """Time several implementations of one point on this rank, interleaved.

    Repeat r runs every implementation once (after a barrier each), starting with the r-th, so all
    of them see the same machine load and every position in the order; returns per implementation
    the times, instrumentation and peak memory.
    """
    track_mmap()
    if cfgs and cfgs[0].get("own_session"):
        own_session()
    rank, size = dist.get_rank(), dist.get_world_size()
    cases = [_Case(cfg, rank, size) for cfg in cfgs]
    for case in cases:
        for _ in range(warmup):
            case.call()
    for r in range(repeats):
        for case in cases[r % len(cases):] + cases[:r % len(cases)]:
            dist.barrier()
            case.timed()
    results = []
    for case in cases:
        dist.barrier()
        results.append(case.result(measure_peak(case.call, case.device)))
    return results
