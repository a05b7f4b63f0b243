"""A small ring-attention check on the current process group: shard, run the ring, compare.

Run by ``launch/ring_demo.py`` under torchrun (or the deepspeed launcher) on CPU processes or GPUs.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megatron_ring.attention.instrument import ring_stats
from megatron_ring.attention.ring import ring_attention
from megatron_ring.attention.sharding import shard_sequence
from megatron_ring.attention.reference import attention_reference, rel_err


def ring_demo(seq_len: int, heads: int, heads_kv: int, head_dim: int, dtype: torch.dtype,
              device: torch.device) -> dict[str, float]:
    """Causal zigzag ring attention over the world group vs a float64 reference; this rank's numbers."""
    rank, size = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, seq_len, heads, head_dim, generator=gen)
    k = torch.randn(1, seq_len, heads_kv, head_dim, generator=gen)
    v = torch.randn(1, seq_len, heads_kv, head_dim, generator=gen)
    ql, kl, vl = (shard_sequence(t, rank, size).to(device, dtype).requires_grad_() for t in (q, k, v))
    with ring_stats() as stats:
        start = time.perf_counter()
        out = ring_attention(ql, kl, vl, causal=True)
        out.sum().backward()
        elapsed = time.perf_counter() - start
    reference = shard_sequence(attention_reference(q, k, v, causal=True), rank, size)
    return {
        "rank": rank, "tokens": ql.shape[1], "rel_err": rel_err(out.cpu(), reference),
        "fwd_bwd_ms": 1e3 * elapsed, "sent_MiB": stats.bytes_sent / 2**20, "ring_steps": stats.steps,
    }
