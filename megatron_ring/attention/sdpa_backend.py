"""The ``sdpa`` block backend: torch's fused attention kernels, unmasked or under key padding and visibility masks (an
additive bias), forward and a backward that takes the *merged* out and lse. No ``Lq x Lk`` matrix of floats.

Layout ``[batch, heads, seq, head_dim]`` (BHSD) and masks (``key_mask``, ``visible``, ``causal``) as in block.py.
Kernels (:data:`KERNELS`, a forward / backward pair of ``torch.ops.aten._scaled_dot_product_*`` each;
:func:`kernel_for` picks):

* ``"cpu_flash"``: ``_flash_attention_for_cpu``: CPU, any float dtype; masks from torch 2.5.
* ``"cudnn"``: ``_cudnn_attention``: CUDA sm_90+ (Hopper), masked or not (about 1.9x torch's flash kernel there
  unmasked, measured on an H200).
* ``"flash"``: ``_flash_attention``: CUDA before Hopper, unmasked (it takes no bias).
* ``"efficient"``: ``_efficient_attention`` (the memory-efficient kernel): CUDA before Hopper, masked.

Note [Masks as a bias, tile by tile]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The ring's backward needs a block backward that takes the merged ``out`` and ``lse`` (Note [Log-sum-exp merge] in
block.py). Every kernel here has one, and all but ``flash`` take an additive bias (0 = seen, -inf = hidden), so one
tiled driver serves CPU and CUDA alike and only the kernel call differs. FlexAttention was the other candidate: its
public API differentiates its own forward (no backward from an external lse) and compiles per mask, and the ring's band
tiles differ per step. A bias costs the kernel one extra read per score, so it is kept small:

* a key padding mask alone is one ``[batch, 1, 1, k_len]`` row, broadcast over heads and queries with stride 0 (as
  torch's own SDPA expands a mask), and the causal flag stays the kernel's;
* a ``visible`` mask (which absorbs ``causal``) becomes a ``[1 or batch, 1, q_len, k_len]`` bias only while that is at
  most :data:`BIAS_ELEMENTS`; beyond, queries are cut into tiles of that many bias elements, each against the key range
  its rows can see, and the tiles' dq / dk / dv are added up. The ring's band masks are at most ``BAND_TILE`` (512)
  square (schedule.py) and decode's have a few query rows, so they run as one tile: no host synchronisation.

So one call holds q, k, v, out, lse, their gradients and at most ``BIAS_ELEMENTS`` bias floats:
``O((Lq + Lk) * heads * head_dim)`` plus the caller's mask. CUDA kernels read bias rows in aligned vectors: rows are
padded to 16 elements (a view keeps the logical width), and the efficient kernel's backward wants the lse of every head
padded to a multiple of 32 queries (the layout of its own forward's lse; heads 8-aligned). A query that sees no key gets
lse -inf and a zero output; its gradients are zero (lse -inf is passed as 0, so every ``exp(score - lse)`` is 0). GQA:
Note [GQA without repeats] in block.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

BIAS_ELEMENTS = 1 << 24
"""Most bias elements one kernel call gets (32 MiB in bf16; Note [Masks as a bias, tile by tile])."""
_aten = torch.ops.aten
"""The ATen op namespace the kernels call through (a CPU stand-in of the CUDA ops in tests)."""

Tensor = torch.Tensor
Bias = Optional[Tensor]
Forward = Callable[[Tensor, Tensor, Tensor, Bias, bool, float], tuple[Tensor, Tensor]]
Backward = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Bias, bool, float], tuple[Tensor, Tensor, Tensor]]


@dataclass(frozen=True)
class BiasKernel:
    """A fused kernel, with an additive bias (None for ``flash``): ``forward(q, k, v, bias, causal, scale) -> (out,
    lse [b, h, q])`` and ``backward(dout, q, k, v, out, lse, bias, causal, scale) -> (dq, dk, dv)``;
    ``align``: bias rows padded to a multiple of it."""

    forward: Forward
    backward: Backward
    align: int


def _full(bias: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """``bias`` expanded (stride 0, no copy) to the ``[b, h, q, k]`` shape the CUDA kernels check."""
    return None if bias is None else bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _cpu_forward(q: Tensor, k: Tensor, v: Tensor, bias: Bias, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    return _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)


def _cpu_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                  bias: Bias, causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=scale)


def _cudnn_forward(q: Tensor, k: Tensor, v: Tensor, bias: Bias, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    out, lse = _aten._scaled_dot_product_cudnn_attention(q, k, v, _full(bias, q, k), True, 0.0, causal, False,
                                                         scale=scale)[:2]
    return out, lse.reshape(q.shape[:3])


def _cudnn_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    bias: Bias, causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    # Not varlen (no cumulative lengths), no dropout (zero RNG state); lse as [b, h, q, 1].
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    return _aten._scaled_dot_product_cudnn_attention_backward(
        dout.contiguous(), q, k, v, out.contiguous(), lse.reshape(*lse.shape, 1).contiguous(), seed, seed,
        _full(bias, q, k), None, None, q.shape[2], k.shape[2], 0.0, causal, scale=scale)


def _flash_forward(q: Tensor, k: Tensor, v: Tensor, bias: Bias, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    return _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)[:2]


def _flash_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    bias: Bias, causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    # Not varlen: no cumulative lengths, max lengths = the block's, zero dropout RNG state.
    seed = torch.zeros(2, dtype=torch.uint64, device=q.device)
    offset = torch.zeros((), dtype=torch.uint64, device=q.device)
    return _aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse.contiguous(), None, None, q.shape[2], k.shape[2], 0.0, causal, seed, offset,
        scale=scale)


def _efficient_forward(q: Tensor, k: Tensor, v: Tensor, bias: Bias, causal: bool,
                       scale: float) -> tuple[Tensor, Tensor]:
    out, lse = _aten._scaled_dot_product_efficient_attention(q, k, v, _full(bias, q, k), True, 0.0, causal,
                                                             scale=scale)[:2]
    return out, lse[..., :q.shape[2]]  # the kernel pads each head's lse to a multiple of 32


def _efficient_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                        bias: Bias, causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    b, h, s = lse.shape
    padded = torch.zeros(b, h, 32 * math.ceil(s / 32), dtype=torch.float32, device=lse.device)
    padded[..., :s] = lse
    seed = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: never read
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, _full(bias, q, k), out, padded, seed, seed, 0.0, [True, True, True, False], causal,
        scale=scale)
    return dq, dk, dv


KERNELS: dict[str, BiasKernel] = {
    "cpu_flash": BiasKernel(_cpu_forward, _cpu_backward, 1),
    "cudnn": BiasKernel(_cudnn_forward, _cudnn_backward, 16),
    "flash": BiasKernel(_flash_forward, _flash_backward, 16),
    "efficient": BiasKernel(_efficient_forward, _efficient_backward, 16),
}


def kernel_for(device: torch.device, masked: bool) -> str:
    """The kernel of :data:`KERNELS` for blocks on ``device``, with a mask or without (the module docstring)."""
    if device.type != "cuda":
        return "cpu_flash"
    if torch.cuda.get_device_capability(device) >= (9, 0):
        return "cudnn"
    return "efficient" if masked else "flash"


def _bias(key_mask: torch.Tensor | None, visible: torch.Tensor | None, groups: int, dtype: torch.dtype,
          align: int) -> torch.Tensor | None:
    """Additive ``[b or 1, 1, q or 1, k]`` bias, -inf where a key is padding or not visible; ``visible``
    repeated ``groups`` times along q for folded query heads. Rows are stored padded to ``align``."""
    hidden = None if key_mask is None else ~key_mask[:, None, :]
    if visible is not None:
        shown = visible.repeat(groups, 1) if groups > 1 else visible
        hidden = ~shown[None] if hidden is None else hidden | ~shown[None]
    if hidden is None:
        return None
    width = hidden.shape[-1]
    store = torch.zeros(*hidden.shape[:-1], align * math.ceil(width / align), dtype=dtype, device=hidden.device)
    return store[..., :width].masked_fill_(hidden, float("-inf"))[:, None]


def _blind(key_mask: torch.Tensor | None, visible: torch.Tensor | None, q_len: int,
           causal: bool) -> torch.Tensor | None:
    """``[b or 1, q]``: the queries that see no key of the block (None without a mask)."""
    if visible is not None:
        sees = visible[None] if key_mask is None else visible[None] & key_mask[:, None, :]
        return ~sees.any(-1)
    if key_mask is None:
        return None
    if causal:
        return key_mask.cumsum(-1) == 0
    return ~key_mask.any(-1, keepdim=True).expand(-1, q_len)


def without_neginf(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (a query that sees no key) replaced by 0, so ``exp(-inf - lse)`` is 0, not NaN."""
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def fold_queries(t: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """``[b, hq, s, ...]`` -> ``[b, hkv, (hq/hkv) * s, ...]``: the query heads of a K/V head as one axis
    (Note [GQA without repeats] in block.py)."""
    b, hq, s = t.shape[:3]
    return t.reshape(b, heads_kv, (hq // heads_kv) * s, *t.shape[3:])


def unfold_queries(t: torch.Tensor, heads_q: int) -> torch.Tensor:
    """Inverse of :func:`fold_queries`: ``[b, hkv, g * s, ...]`` -> ``[b, heads_q, s, ...]``."""
    b, hkv, gs = t.shape[:3]
    return t.reshape(b, heads_q, gs // (heads_q // hkv), *t.shape[3:])


def _setup(q: torch.Tensor, k: torch.Tensor, causal: bool, key_mask: torch.Tensor | None, visible: torch.Tensor | None,
           kernel: str | None) -> tuple[BiasKernel, bool, torch.Tensor | None, list[tuple[slice, slice]]]:
    """The kernel (default :func:`kernel_for` q's device), ``causal`` and ``visible`` (which absorbs a causal flag: one
    mask for the kernel) and the :func:`_plan` of a call."""
    chosen = KERNELS[kernel or kernel_for(q.device, key_mask is not None or visible is not None)]
    if visible is not None and causal:
        visible, causal = visible & torch.ones_like(visible).tril_(), False
    return chosen, causal, visible, _plan(q, k, key_mask, visible)


def _tiles(q_len: int, k_len: int, rows_per_query: int, visible: torch.Tensor | None) -> list[slice]:
    """Query tiles whose bias stays within :data:`BIAS_ELEMENTS` (one tile without ``visible``)."""
    if visible is None or q_len * k_len * rows_per_query <= BIAS_ELEMENTS:
        return [slice(0, q_len)]
    step = max(1, BIAS_ELEMENTS // (k_len * rows_per_query))
    return [slice(i, min(i + step, q_len)) for i in range(0, q_len, step)]


def _reach(visible: torch.Tensor, rows: slice) -> slice:
    """The keys some query of ``rows`` sees (an empty slice when none: a host sync, tiles only)."""
    seen = visible[rows].any(0).nonzero()
    return slice(0, 0) if seen.numel() == 0 else slice(int(seen[0]), int(seen[-1]) + 1)


def _plan(q: torch.Tensor, k: torch.Tensor, key_mask: torch.Tensor | None,
          visible: torch.Tensor | None) -> list[tuple[slice, slice]]:
    """``(query rows, key columns)`` of every kernel call (Note [Masks as a bias, tile by tile])."""
    b, hq, q_len, _ = q.shape
    rows_per_query = (hq // k.shape[1]) * (1 if key_mask is None else b)
    tiles = _tiles(q_len, k.shape[2], rows_per_query, visible)
    if len(tiles) == 1:
        return [(tiles[0], slice(0, k.shape[2]))]
    return [(rows, _reach(visible, rows)) for rows in tiles]


def _sliced(key_mask: torch.Tensor | None, visible: torch.Tensor | None, rows: slice,
            cols: slice) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The masks of one tile: ``key_mask[:, cols]``, ``visible[rows, cols]``."""
    return (None if key_mask is None else key_mask[:, cols]), (None if visible is None else visible[rows, cols])


def _tile_forward(kernel: BiasKernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                  key_mask: torch.Tensor | None, visible: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One kernel call (one per head slice under ``causal``): ``(out [b, hq, q, d] in q's dtype,
    lse [b, hq, q] in the kernel's dtype)``."""
    heads_q, groups, q_len = q.shape[1], q.shape[1] // k.shape[1], q.shape[2]
    if groups > 1 and causal:  # Note [GQA without repeats] in block.py: head slices
        out, lse = torch.empty_like(q), None
        for j in range(groups):
            o, l = _tile_forward(kernel, q[:, j::groups], k, v, causal, scale, key_mask, visible)
            lse = torch.empty(q.shape[:3], dtype=l.dtype, device=q.device) if lse is None else lse
            out[:, j::groups], lse[:, j::groups] = o, l
            del o, l  # one slice's output alive at a time
        return out, lse
    # Note [GQA without repeats]: folded (a view of the same strides when groups == 1)
    q = fold_queries(q, k.shape[1])
    out, lse = kernel.forward(q, k, v, _bias(key_mask, visible, groups, q.dtype, kernel.align), causal, scale)
    out, lse = unfold_queries(out, heads_q), unfold_queries(lse, heads_q)
    blind = _blind(key_mask, visible, q_len, causal)
    if blind is not None:  # the kernels' lse and output for such a query are not -inf and 0
        lse = lse.masked_fill(blind[:, None, :], float("-inf"))
        out = out.masked_fill(blind[:, None, :, None], 0.0)
    return out, lse


def _tile_backward(kernel: BiasKernel, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, causal: bool, scale: float, key_mask: torch.Tensor | None,
                   visible: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One kernel call (one per head slice under ``causal``): ``(dq [b, hq, q, d], dk, dv [b, hkv, k, d])``."""
    heads_q, groups = q.shape[1], q.shape[1] // k.shape[1]
    if groups > 1 and causal:  # head slices, as in _tile_forward; dK/dV summed over them
        ct = torch.promote_types(q.dtype, torch.float32)
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        dk, dv = (torch.zeros(k.shape, dtype=ct, device=q.device) for _ in range(2))
        for j in range(groups):
            dq[:, j::groups], dk_j, dv_j = _tile_backward(kernel, dout[:, j::groups], q[:, j::groups], k, v,
                                                          out[:, j::groups], lse[:, j::groups], causal, scale,
                                                          key_mask, visible)
            dk += dk_j
            dv += dv_j
        return dq, dk, dv
    q, dout, out, lse = (fold_queries(t, k.shape[1]) for t in (q, dout, out, lse))
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, _bias(key_mask, visible, groups, q.dtype, kernel.align),
                                 causal, scale)
    return unfold_queries(dq, heads_q), dk, dv


def sdpa_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
                 key_mask: torch.Tensor | None, visible: torch.Tensor | None,
                 kernel: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q ``[b, hq, sq, d]`` over k, v ``[b, hkv, sk, d]`` under the masks (None: none), on ``kernel`` (see
    :func:`_setup`): ``(out [b, hq, sq, d] in q's dtype, lse [b, hq, sq] in the kernel's dtype)``; a query that sees no
    key gets a zero output and lse -inf."""
    chosen, causal, visible, plan = _setup(q, k, causal, key_mask, visible, kernel)
    if len(plan) == 1:
        return _tile_forward(chosen, q, k, v, causal, scale, key_mask, visible)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
    for rows, cols in plan:
        if cols.stop > cols.start:
            o, l = _tile_forward(chosen, q[:, :, rows], k[:, :, cols], v[:, :, cols], causal, scale,
                                 *_sliced(key_mask, visible, rows, cols))
            out[:, :, rows], lse[:, :, rows] = o, l
    return out, lse


def sdpa_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, *, causal: bool, scale: float, key_mask: torch.Tensor | None,
                  visible: torch.Tensor | None,
                  kernel: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the merged ``out`` (q's dtype) and ``lse`` (fp32, fp64 for fp64
    inputs) of these queries: ``(dq [b, hq, sq, d], dk, dv [b, hkv, sk, d])`` in the kernel's dtypes."""
    chosen, causal, visible, plan = _setup(q, k, causal, key_mask, visible, kernel)
    lse = without_neginf(lse)
    if len(plan) == 1:
        return _tile_backward(chosen, dout, q, k, v, out, lse, causal, scale, key_mask, visible)
    ct = torch.promote_types(q.dtype, torch.float32)
    dq = torch.zeros(q.shape, dtype=ct, device=q.device)
    dk, dv = (torch.zeros(k.shape, dtype=ct, device=q.device) for _ in range(2))
    for rows, cols in plan:
        if cols.stop > cols.start:
            dq_t, dk_t, dv_t = _tile_backward(chosen, dout[:, :, rows], q[:, :, rows], k[:, :, cols], v[:, :, cols],
                                              out[:, :, rows], lse[:, :, rows], causal, scale,
                                              *_sliced(key_mask, visible, rows, cols))
            dq[:, :, rows] += dq_t
            dk[:, :, cols] += dk_t
            dv[:, :, cols] += dv_t
    return dq, dk, dv
