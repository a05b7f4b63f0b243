"""The single-process checks of the prepared device check (device_check.py), one function each.

Every check returns rows ``{"check", "case", "metric", "value", "target", "ok"}``: ``ok`` is None
for a figure with no target. Sizes come from the caller, so the same code runs on tiny CPU
inputs (``--cpu-dry-run``, in CI) and at full size on a GPU.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from megatron_ring.attention.block import block_backward, block_forward, resolve_backend
from megatron_ring.attention.call import RingCall
from megatron_ring.attention.comms import CPPlace
from megatron_ring.attention.decode import decode_attention
from megatron_ring.attention.reference import attention_reference, rel_err
from megatron_ring.attention.ring import ring_forward
from megatron_ring.attention.schedule import schedule_for
from megatron_ring.attention.sharding import shard_sequence
from megatron_ring.attention.transport import Block
from megatron_ring.perf.bench.harness import measure_peak, median_time

Row = dict[str, Any]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 1e-2}


def row(check: str, case: str, metric: str, value: float, target: str | None = None,
        ok: bool | None = None) -> Row:
    return {"check": check, "case": case, "metric": metric, "value": value, "target": target, "ok": ok}


def _qkv(batch: int, seq: int, heads: int, heads_kv: int, dim: int, dtype: torch.dtype,
         device: torch.device) -> list[torch.Tensor]:
    """q, k, v ``[batch, seq, heads, dim]`` (k/v with ``heads_kv``), seeded."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(batch, seq, h, dim, generator=gen).to(device, dtype) for h in (heads, heads_kv, heads_kv)]


def _backends(device: torch.device, dtype: torch.dtype, dim: int) -> list[str]:
    """Every kernel ``auto`` may choose here, and ``math``."""
    names = {"math", resolve_backend("auto", device, dtype, dim)}
    try:
        names.add(resolve_backend("flash_attn", device, dtype, dim))
    except ValueError:
        pass
    return sorted(names)


def kernels(device: torch.device, dtypes: Sequence[torch.dtype], seq: int, dim: int) -> Iterator[Row]:
    """Each block kernel vs float64, forward and backward, causal and full, GQA 4:2."""
    for dtype in dtypes:
        for backend in _backends(device, dtype, dim):
            for causal in (True, False):
                inputs = _qkv(1, seq, 4, 2, dim, dtype, device)
                leaves = [t.detach().cpu().double().requires_grad_() for t in inputs]  # the reference runs on CPU
                ref = attention_reference(*leaves, causal=causal)
                dout = torch.randn_like(ref)
                expected = torch.autograd.grad(ref, leaves, dout)
                q, k, v = (t.transpose(1, 2) for t in inputs)
                out, lse = block_forward(q, k, v, causal=causal, scale=dim ** -0.5, backend=backend)
                grads = block_backward(dout.transpose(1, 2).to(device, dtype), q, k, v, out.to(dtype), lse,
                                       causal=causal, scale=dim ** -0.5, backend=backend)
                worst = max([rel_err(out.transpose(1, 2).cpu(), ref)]
                            + [rel_err(g.transpose(1, 2).cpu(), e) for g, e in zip(grads, expected)])
                case = f"{backend} {str(dtype)[6:]} {'causal' if causal else 'full'} L={seq}"
                yield row("kernels", case, "max rel. err (out, dq, dk, dv) vs float64", worst,
                          f"<= {TOLERANCE[dtype]:g}", worst <= TOLERANCE[dtype])


def block_vs_sdpa(device: torch.device, dtype: torch.dtype, seqs: Sequence[int], dims: Sequence[int],
                  repeats: int) -> Iterator[Row]:
    """The ring's block kernel vs torch's SDPA (its fastest backend) on the whole sequence, one call:
    speed ratio ``t_sdpa / t_block``, forward and forward+backward, causal, MHA 8 and GQA 8:2."""
    for seq in seqs:
        for dim in dims:
            for heads_kv in (8, 2):
                q, k, v = (t.transpose(1, 2).requires_grad_() for t in _qkv(1, seq, 8, heads_kv, dim, dtype, device))
                kr, vr = (t.repeat_interleave(8 // heads_kv, dim=1).detach().requires_grad_() for t in (k, v))
                backend = resolve_backend("auto", device, dtype, dim)
                out, lse = block_forward(q, k, v, causal=True, scale=dim ** -0.5, backend=backend)
                dout = torch.randn_like(q)
                case = f"{backend} L={seq} d={dim} kv={heads_kv}"
                ours = {"fwd": lambda: block_forward(q, k, v, causal=True, scale=dim ** -0.5, backend=backend),
                        "fwd+bwd": lambda: block_backward(dout, q, k, v, out.to(dtype), lse, causal=True,
                                                          scale=dim ** -0.5, backend=backend)}
                theirs = {"fwd": lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=True),
                          "fwd+bwd": lambda: F.scaled_dot_product_attention(q, kr, vr, is_causal=True).backward(dout)}
                for mode in ("fwd", "fwd+bwd"):
                    base = median_time(theirs[mode], device, repeats)
                    mine = median_time(ours[mode], device, repeats) + (median_time(ours["fwd"], device, repeats)
                                                                 if mode == "fwd+bwd" else 0.0)
                    yield row("block_vs_sdpa", f"{case} {mode}", "speed vs SDPA (t_sdpa / t_block)", base / mine,
                              ">= 0.95", base / mine >= 0.95 if device.type == "cuda" else None)


class LocalBlocks:
    """A transport that hands out shards already in memory: one rank's ring schedule with the
    transfers taken out (Note [Overlap and double buffering] has nothing to hide)."""

    def __init__(self, ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor], rank: int) -> None:
        self.ks, self.vs, self.rank = ks, vs, rank

    def blocks(self, k: torch.Tensor, v: torch.Tensor) -> Iterator[Block]:
        size = len(self.ks)
        for step in range(size):
            src = (self.rank - step) % size
            yield src, slice(0, k.shape[1]), self.ks[src], self.vs[src]


def decomposition(device: torch.device, dtype: torch.dtype, seq: int, sizes: Sequence[int], dim: int,
                  repeats: int) -> Iterator[Row]:
    """One rank's causal zigzag ring (rank 0's blocks and merges, local shards for transfers) vs one
    SDPA call over the whole sequence: efficiency ``t_sdpa / (P * t_rank)``."""
    q, k, v = (t.transpose(1, 2) for t in _qkv(1, seq, 8, 8, dim, dtype, device))
    base = median_time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), device, repeats)
    backend = resolve_backend("auto", device, dtype, dim)
    for size in sizes:
        shards = [[shard_sequence(t, r, size, dim=2).contiguous() for r in range(size)] for t in (q, k, v)]
        schedule = schedule_for(0, size, seq // size, None, causal=True, sharding="zigzag", window=(-1, -1))
        call = RingCall(CPPlace(0, size, None, True, None), "p2p", True, "zigzag", dim ** -0.5, backend, False,
                        schedule)
        transport = LocalBlocks(shards[1], shards[2], 0)
        mine = median_time(lambda: ring_forward(call, transport, shards[0][0], shards[1][0], shards[2][0], None),
                     device, repeats)
        efficiency = base / (size * mine)
        yield row("decomposition", f"P={size} L/P={seq // size} {str(dtype)[6:]}", "efficiency t_sdpa / (P t_rank)",
                  efficiency, ">= 0.9 at L/P >= 8k", efficiency >= 0.9 if seq // size >= 8192 and device.type == "cuda"
                  else None)


def decode(device: torch.device, dtype: torch.dtype, batches: Sequence[int], cached: Sequence[int], dim: int,
           repeats: int) -> Iterator[Row]:
    """``decode_attention`` on one long shard: K/V bytes read per second vs the copy bandwidth."""
    for batch in batches:
        for n in cached:
            q, k, v = _qkv(batch, 1, 8, 2, dim, dtype, device)
            kc, vc = (torch.randn(batch, n, 2, dim, device=device).to(dtype) for _ in range(2))
            spent = median_time(lambda: decode_attention(q, kc, vc, check_consistency=False), device, repeats)
            flat = kc.reshape(-1)
            copy = median_time(lambda: flat.clone(), device, repeats)
            read = 2 * kc.numel() * kc.element_size() / spent
            copy_rate = 2 * flat.numel() * flat.element_size() / copy  # read + write
            yield row("decode", f"batch={batch} cached={n}", "K/V bytes read/s vs copy bandwidth", read / copy_rate)


def masked(device: torch.device, dtype: torch.dtype, seq: int, dim: int, repeats: int) -> Iterator[Row]:
    """Masked calls as the ring makes them, causal, GQA 8:2: a padded batch (10 % padding, one block
    with a key mask) and a window of L/8 (the schedule's band tiles, P = 1): error vs float64, time
    per visible pair and peak memory relative to unmasked causal SDPA."""
    q, k, v = _qkv(1, seq, 8, 2, dim, dtype, device)
    qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    kr, vr = (t.repeat_interleave(4, dim=1) for t in (kh, vh))
    real, width = seq - seq // 10, seq // 8
    keep = torch.arange(seq, device=device)[None, :] < real
    backend = resolve_backend("auto", device, dtype, dim, masked=True)
    schedule = schedule_for(0, 1, seq, None, causal=True, sharding="zigzag", window=(width, 0))
    call = RingCall(CPPlace(0, 1, None, True, None), "p2p", True, "zigzag", dim ** -0.5, backend, False, schedule)
    cases: dict[str, tuple[Callable[[], tuple[torch.Tensor, torch.Tensor]], dict[str, Any], int]] = {
        "padding 10%": (lambda: block_forward(qh, kh, vh, causal=True, scale=dim ** -0.5, backend=backend,
                                              key_mask=keep),
                        dict(causal=True, key_padding_mask=keep.cpu()), sum(min(i, real - 1) + 1 for i in range(seq))),
        f"window {width}": (lambda: ring_forward(call, LocalBlocks([kh], [vh], 0), qh, kh, vh, None),
                            dict(causal=True, window_size=(width, 0)), sum(min(i, width) + 1 for i in range(seq))),
    }
    full = median_time(lambda: F.scaled_dot_product_attention(qh, kr, vr, is_causal=True), device, repeats)
    per_full_pair = full / (seq * (seq + 1) / 2)
    full_memory = measure_peak(lambda: F.scaled_dot_product_attention(qh, kr, vr, is_causal=True), device) \
        if device.type == "cuda" else 0
    for name, (run, reference, pairs) in cases.items():
        out, _ = run()
        err = rel_err(out.transpose(1, 2).cpu(), attention_reference(q.cpu(), k.cpu(), v.cpu(), **reference))
        on_gpu = device.type == "cuda"
        yield row("masked", f"{backend} {name}", "rel. err vs float64", err, f"<= {TOLERANCE[dtype]:g}",
                  err <= TOLERANCE[dtype])
        ratio = median_time(run, device, repeats) / pairs / per_full_pair
        yield row("masked", f"{backend} {name}", "time per visible pair vs unmasked SDPA", ratio,
                  "<= 1.25 (>= 0.8x its speed)", ratio <= 1.25 if on_gpu else None)
        memory = measure_peak(run, device) / full_memory if on_gpu else float("nan")
        yield row("masked", f"{backend} {name}", "peak memory vs unmasked SDPA", memory, "<= 1.2",
                  memory <= 1.2 if on_gpu else None)
