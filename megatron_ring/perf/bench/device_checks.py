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
from megatron_ring.attention.call import RingCall, whole_piece
from megatron_ring.attention.call import CPPlace
from megatron_ring.attention.decode import decode_attention
from megatron_ring.attention.reference import attention_reference, rel_err
from megatron_ring.attention.ring import ring_backward, ring_forward
from megatron_ring.attention.schedule import Piece, schedule_for
from megatron_ring.attention.sdpa_backend import kernel_for, sdpa_backward, sdpa_forward
from megatron_ring.attention.sharding import shard_sequence
from megatron_ring.attention.transport import Block, BlockAndGrads, GradPieces, add_pieces
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

    def __init__(self, ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor], rank: int, piece: Piece) -> None:
        self.ks, self.vs, self.rank, self.piece = ks, vs, rank, piece

    def blocks(self, k: torch.Tensor, v: torch.Tensor) -> Iterator[Block]:
        size = len(self.ks)
        for step in range(size):
            src = (self.rank - step) % size
            yield src, self.piece, self.ks[src], self.vs[src]

    def blocks_and_grads(self, k: torch.Tensor, v: torch.Tensor, dkv: torch.Tensor) -> Iterator[BlockAndGrads]:
        """The same blocks in backward; the own block's gradient pieces are added into ``dkv``, the
        others' dropped (their owners are not here)."""
        for src, piece, k_src, v_src in self.blocks(k, v):
            pieces: GradPieces = []
            yield src, piece, k_src, v_src, pieces
            if src == self.rank:
                add_pieces(dkv, pieces)


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
        piece = whole_piece(schedule, q.shape[1], k.shape[1])
        call = RingCall(CPPlace(0, size, None, True, None), "p2p", True, "zigzag", dim ** -0.5, backend, False,
                        (piece,))
        transport = LocalBlocks(shards[1], shards[2], 0, piece)
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


def _masked_kernels(device: torch.device) -> list[str]:
    """The sdpa_backend kernels that take a mask on ``device`` (the default first): on Hopper both
    CUDA candidates, so the measurement can choose between them."""
    default = kernel_for(device, masked=True)
    return [default, "efficient"] if default == "cudnn" else [default]


def _ring_pass(call: RingCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor | None
               ) -> list[torch.Tensor]:
    """One rank's ring (P = 1, this call's schedule and kernel): out, and dq, dk, dv with ``dout``."""
    out, lse = ring_forward(call, LocalBlocks([k], [v], 0, call.pieces[0]), q, k, v, None)
    if dout is None:
        return [out]
    return [out, *ring_backward(call, LocalBlocks([k], [v], 0, call.pieces[0]), q, k, v, out.to(q.dtype), lse, dout,
                                None)]


def _sdpa_pass(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor | None,
               key_mask: torch.Tensor) -> list[torch.Tensor]:
    """One causal block with a key padding mask on ``kernel``: out, and dq, dk, dv with ``dout``."""
    scale = q.shape[-1] ** -0.5
    out, lse = sdpa_forward(q, k, v, causal=True, scale=scale, key_mask=key_mask, visible=None, kernel=kernel)
    if dout is None:
        return [out]
    return [out, *sdpa_backward(dout, q, k, v, out, lse.float(), causal=True, scale=scale, key_mask=key_mask,
                                visible=None, kernel=kernel)]


MaskedCase = tuple[Callable[[bool], list[torch.Tensor]], dict[str, Any], int]
"""``run(backward)``, the reference's keyword arguments, the visible (query, key) pairs."""


def _masked_cases(device: torch.device, dtype: torch.dtype, seq: int, heads: tuple[int, int], dim: int
                  ) -> tuple[list[torch.Tensor], dict[str, MaskedCase]]:
    """q, k, v, dout ``[1, seq, h, dim]`` and, per case, ``run(backward)`` on heads-first copies, the
    reference's keyword arguments and the visible (query, key) pairs: a padded batch (the last 10 %
    of keys padding, one causal block, each masked kernel), a causal window of seq/8 (the ring's
    band tiles, P = 1) and two packed documents under that window."""
    q, k, v = _qkv(1, seq, *heads, dim, dtype, device)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    qh, kh, vh, dh = (t.transpose(1, 2).contiguous() for t in (q, k, v, dout))
    real, width = seq - seq // 10, seq // 8
    keep = torch.arange(seq, device=device)[None, :] < real
    backend = resolve_backend("auto", device, dtype, dim, masked=True)

    def ring(window: tuple[int, int], docs: tuple[int, ...] | None) -> RingCall:
        schedule = schedule_for(0, 1, seq, docs, causal=True, sharding="zigzag", window=window)
        return RingCall(CPPlace(0, 1, None, True, None), "p2p", True, "zigzag", dim ** -0.5, backend, False,
                        (whole_piece(schedule, heads[0], heads[1]),))

    windowed, packed = ring((width, 0), None), ring((width, 0), (seq // 2, seq // 2))
    padded_pairs = sum(min(i, real - 1) + 1 for i in range(seq))
    cases: dict[str, MaskedCase] = {
        f"padding 10% {kernel}": (
            lambda backward, kernel=kernel: _sdpa_pass(kernel, qh, kh, vh, dh if backward else None, keep),
            dict(causal=True, key_padding_mask=keep.cpu()), padded_pairs)
        for kernel in _masked_kernels(device)}
    cases[f"window {width} {backend}"] = (lambda backward: _ring_pass(windowed, qh, kh, vh, dh if backward else None),
                                          dict(causal=True, window_size=(width, 0)),
                                          sum(min(i, width) + 1 for i in range(seq)))
    half = seq // 2
    cases[f"documents 2 + window {width} {backend}"] = (
        lambda backward: _ring_pass(packed, qh, kh, vh, dh if backward else None),
        dict(causal=True, window_size=(width, 0), cu_seqlens=torch.tensor([0, half, seq])),
        2 * sum(min(i, width) + 1 for i in range(half)))
    return [q, k, v, dout], cases


def masked(device: torch.device, dtype: torch.dtype, seq: int, err_seq: int, heads: tuple[int, int], dim: int,
           repeats: int) -> Iterator[Row]:
    """Masked calls as the ring makes them (:func:`_masked_cases`): error of out, dq, dk, dv vs
    float64 at ``err_seq`` (8:2 heads) and of a decode step windowed on positions; then at ``seq``
    with ``heads`` the time per visible pair and the peak memory, forward and forward+backward,
    relative to unmasked causal SDPA (GQA without repeats). No case builds an ``L x L`` matrix
    (Note [Masks as a bias, tile by tile] in attention/sdpa_backend.py)."""
    on_gpu = device.type == "cuda"
    (q, k, v, dout), cases = _masked_cases(device, dtype, err_seq, (8, 2), dim)
    for name, (run, reference, _) in cases.items():
        leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
        kwargs = dict(reference)
        if "cu_seqlens" in kwargs:  # the reference takes packed documents as [tokens, heads, head_dim]
            ref = attention_reference(*(t[0] for t in leaves), **kwargs)[None]
        else:
            ref = attention_reference(*leaves, **kwargs)
        expected = [ref, *torch.autograd.grad(ref, leaves, dout.cpu().double())]
        got = run(True)
        worst = max(rel_err(g.transpose(1, 2).cpu(), e) for g, e in zip(got, expected))
        yield row("masked", f"{name} L={err_seq}", "max rel. err (out, dq, dk, dv) vs float64", worst,
                  f"<= {TOLERANCE[dtype]:g}", worst <= TOLERANCE[dtype])
    width, order = err_seq // 8, torch.randperm(err_seq, generator=torch.Generator().manual_seed(2))
    got = decode_attention(q[:, -1:], k[:, order.to(device)], v[:, order.to(device)], window_size=(width, 0),
                           q_positions=torch.tensor([err_seq - 1]), k_positions=order, check_consistency=False)
    ref = attention_reference(q.cpu().double(), k.cpu().double(), v.cpu().double(), causal=True,
                              window_size=(width, 0))[:, -1:]
    err = rel_err(got.cpu(), ref)
    yield row("masked", f"decode, window {width} on positions in any order L={err_seq}", "rel. err vs float64", err,
              f"<= {TOLERANCE[dtype]:g}", err <= TOLERANCE[dtype])
    (q, k, v, dout), cases = _masked_cases(device, dtype, seq, heads, dim)
    qh, kh, vh = (t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    dh = dout.transpose(1, 2).contiguous()
    causal_pairs = seq * (seq + 1) / 2

    def unmasked(backward: bool) -> None:
        out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=True)
        if backward:
            torch.autograd.grad(out, (qh, kh, vh), dh)

    for mode, backward in (("fwd", False), ("fwd+bwd", True)):
        per_pair = median_time(lambda: unmasked(backward), device, repeats) / causal_pairs
        memory = measure_peak(lambda: unmasked(backward), device) if on_gpu else 0
        for name, (run, _, pairs) in cases.items():
            case = f"{name} L={seq} {heads[0]}:{heads[1]} {mode}"
            ratio = median_time(lambda: run(backward), device, repeats) / pairs / per_pair
            yield row("masked", case, "time per visible pair vs unmasked SDPA", ratio,
                      "<= 1.25 (>= 0.8x its speed)", ratio <= 1.25 if on_gpu else None)
            peak = measure_peak(lambda: run(backward), device) / memory if on_gpu else float("nan")
            yield row("masked", case, "peak memory vs unmasked SDPA", peak, "<= 1.2", peak <= 1.2 if on_gpu else None)
