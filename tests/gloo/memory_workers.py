"""Peak memory of one ring call on this rank (run on every rank of a gloo pool)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_ring import ring_attention, shard_sequence
from megatron_ring.perf.bench.harness import measure_peak, track_mmap


def ring_call_peak(seq_local: int, heads: int, head_dim: int, grad: bool) -> float:
    """This rank's peak memory during one causal fp32 ``ring_attention`` call (forward, or forward and
    backward when ``grad``) on zigzag shards, above its inputs, in units of its local q ``[1, seq_local,
    heads, head_dim]`` (Note [Peak memory on CPU] in perf/bench/harness.py)."""
    track_mmap()
    rank, size = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    shape = (1, seq_local * size, heads, head_dim)
    q, k, v, dout = (shard_sequence(torch.randn(shape, generator=gen), rank, size).contiguous() for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(grad)

    def call() -> None:
        out = ring_attention(q, k, v, causal=True)
        if grad:
            out.backward(dout)
            for t in (q, k, v):
                t.grad = None

    call()  # the first call also initialises the kernels
    dist.barrier()
    return measure_peak(call, q.device) / (q.numel() * q.element_size())
