"""Ranks of the turn-attention tests: a new turn against a cache sharded over the group, vs float64."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_ring.attention.reference import attention_reference, rel_err
from megatron_ring.attention.turn import turn_attention

CASES = [  # (cached tokens, new tokens, window left)
    (23, 7, -1),   # a follow-up question after a document
    (17, 1, -1),   # one new token: most ranks get no query
    (0, 9, -1),    # a turn on an empty cache: a plain causal prefill
    (30, 11, 5),   # a sliding window that hides most of the cache
    (3, 26, -1),   # a turn longer than the cache
]


def _shard(positions: torch.Tensor, owner: torch.Tensor, rank: int, gen: torch.Generator) -> torch.Tensor:
    mine = positions[owner == rank]
    return mine[torch.randperm(mine.numel(), generator=gen)]  # any order


def turn_vs_reference(heads_q: int, heads_kv: int, head_dim: int, modes: list[str]) -> list[dict]:
    """Every case x mode x dtype on this rank: error against float64 and the output's dtype and shape."""
    rank, size = dist.get_rank(), dist.get_world_size()
    results = []
    for cached, new, left in CASES:
        total = cached + new
        gen = torch.Generator().manual_seed(7 + total)
        q64, k64, v64 = (torch.randn(2, total, h, head_dim, generator=gen, dtype=torch.float64)
                         for h in (heads_q, heads_kv, heads_kv))
        owner = torch.randint(size, (cached,), generator=gen)  # the cache: any split, empty shards allowed
        positions = torch.arange(total)
        cache_pos = _shard(positions[:cached], owner, rank, gen)
        new_pos = positions[cached:][positions[cached:] % size == rank]  # new tokens: round-robin
        shuffled = torch.cat([cache_pos, new_pos])
        ref = attention_reference(q64, k64, v64, causal=True, window_size=(left, 0))[:, new_pos]
        # keys in any order (one masked call), and in ascending order as a cache holds them (the prefix that
        # every query sees runs unmasked)
        for k_pos, mode in [(shuffled, m) for m in modes] + [(shuffled.sort().values, m) for m in modes[:2]]:
            for dtype in (torch.float32, torch.bfloat16):
                q, k, v = (t.to(dtype) for t in (q64, k64, v64))
                out = turn_attention(q[:, new_pos], k[:, k_pos], v[:, k_pos], q_positions=new_pos,
                                     k_positions=k_pos, mode=mode, window_size=(left, 0))
                results.append({"case": (cached, new, left), "mode": mode, "dtype": dtype, "out_dtype": out.dtype,
                                "shape": tuple(out.shape), "want": (2, new_pos.numel(), heads_q, head_dim),
                                "err": rel_err(out, ref) if new_pos.numel() else 0.0})
    return results


def mismatched_mode() -> str:
    """Rank 0 asks for pass-KV, the others for pass-Q: every rank raises naming the mode."""
    rank = dist.get_rank()
    x = torch.randn(1, 2, 2, 4)
    try:
        turn_attention(x, x, x, q_positions=torch.arange(2) + 10 * rank, k_positions=torch.arange(2) + 10 * rank,
                       mode="pass_kv" if rank == 0 else "pass_q")
    except ValueError as err:
        return str(err)
    return "no error"


def decode_rows_vs_reference(heads_q: int, heads_kv: int, head_dim: int, lengths: list[int], left: int) -> list[dict]:
    """decode_attention_rows of sequences of ``lengths`` (each split over the ranks in any way) vs float64."""
    from megatron_ring.attention.decode import decode_attention_rows

    rank, size = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(3)
    results = []
    for dtype in (torch.float32, torch.bfloat16):
        q64 = torch.randn(len(lengths), 1, heads_q, head_dim, generator=gen, dtype=torch.float64)
        shards, k_pos, refs = [], [], []
        drawn = [(torch.randn(1, n, heads_kv, head_dim, generator=gen, dtype=torch.float64),
                  torch.randn(1, n, heads_kv, head_dim, generator=gen, dtype=torch.float64),
                  torch.randint(size, (n,), generator=gen)) for n in lengths]  # the same on every rank
        order = torch.Generator().manual_seed(rank)
        for j, (n, (k64, v64, owner)) in enumerate(zip(lengths, drawn)):
            mine = _shard(torch.arange(n), owner, rank, order)
            shards.append((k64[:, mine].to(dtype), v64[:, mine].to(dtype)))
            k_pos.append(mine)
            q_full = torch.zeros(1, n, heads_q, head_dim, dtype=torch.float64)
            q_full[:, -1] = q64[j, 0]  # the new token's query at position n - 1 (its own K/V cached)
            refs.append(attention_reference(q_full, k64, v64, causal=True, window_size=(left, 0))[:, -1:])
        q_pos = torch.tensor([[n - 1] for n in lengths])
        window = (-1, -1) if left < 0 else (left, 0)
        out = decode_attention_rows(q64.to(dtype), shards, window_size=window, q_positions=q_pos, k_positions=k_pos)
        results.append({"dtype": dtype, "out_dtype": out.dtype, "err": rel_err(out, torch.cat(refs))})
    return results
