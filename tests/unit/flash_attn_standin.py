"""A CPU stand-in for the flash-attn package's interface, to check our adapter's calls without a GPU.

It exposes the two entry points the adapter uses, with the signatures of two real releases:
``flash_attn_func`` (public) and ``_flash_attn_backward`` — a ``torch.library.custom_op`` taking
``window_size_left``/``_right`` and ``softcap`` as in 2.7, or a plain function taking a
``window_size`` tuple as in 2.6. It enforces the checks the CUDA kernels make (dtype, unit stride on
head_dim, shapes, GQA head ratio, a contiguous fp32 ``[b, h, sq]`` log-sum-exp, preallocated
gradients written in place) and computes in float64. It is not flash-attn: only a GPU run checks
the real kernels (tests/unit/test_flash_attn_backend.py does when one is present).
"""
from __future__ import annotations

import types
from typing import Optional

import torch


def _check(name: str, cond: bool) -> None:
    if not cond:
        raise RuntimeError(f"flash-attn stand-in: {name}")


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    _check("q dtype fp16/bf16", q.dtype in (torch.float16, torch.bfloat16))
    _check("q, k, v same dtype", k.dtype == q.dtype and v.dtype == q.dtype)
    for t in (q, k, v):
        _check("unit stride on head_dim", t.dim() == 4 and t.stride(-1) == 1)
    _check("k, v shapes", k.shape == v.shape and k.shape[0] == q.shape[0] and k.shape[3] == q.shape[3])
    _check("heads_q % heads_kv == 0", q.shape[2] % k.shape[2] == 0)


def _probs_parts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool):
    """float64 scores ``[b, h, sq, sk]`` and K/V repeated to the query heads ``[b, sk, h, d]``."""
    groups = q.shape[2] // k.shape[2]
    kk, vv = (t.double().repeat_interleave(groups, dim=2) for t in (k, v))
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), kk) * scale
    if causal:  # bottom-right aligned, as flash-attn >= 2.1
        sq, sk = q.shape[1], k.shape[1]
        scores.masked_fill_(torch.ones(sq, sk, dtype=torch.bool).triu_(sk - sq + 1), float("-inf"))
    return scores, kk, vv


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """``[b, s, h, d]`` inputs; returns out, or ``(out, lse [b, h, sq] fp32, S)`` with return_attn_probs."""
    _check_qkv(q, k, v)
    _check("plain attention", dropout_p == 0.0 and tuple(window_size) == (-1, -1) and softcap == 0.0
           and alibi_slopes is None)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    scores, _, vv = _probs_parts(q, k, v, scale, causal)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(scores - lse.unsqueeze(-1)), vv).to(q.dtype)
    return (out, lse.float(), torch.empty(0, dtype=q.dtype)) if return_attn_probs else out


def _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal) -> torch.Tensor:
    _check_qkv(q, k, v)
    b, sq, hq, d = q.shape
    _check("head_dim multiple of 8 up to 256", d % 8 == 0 and d <= 256)
    for t in (dout, out):
        _check("dout/out shape, dtype, unit stride", t.shape == q.shape and t.dtype == q.dtype and t.stride(-1) == 1)
    _check("lse contiguous fp32 [b, h, sq]", softmax_lse.shape == (b, hq, sq) and softmax_lse.dtype == torch.float32
           and softmax_lse.is_contiguous())
    for grad, like in ((dq, q), (dk, k), (dv, v)):
        _check("preallocated gradients", grad is not None and grad.shape == like.shape and grad.dtype == q.dtype
               and grad.stride(-1) == 1)
    _check("no dropout", dropout_p == 0.0)
    scores, kk, vv = _probs_parts(q, k, v, softmax_scale, causal)
    probs = torch.exp(scores - softmax_lse.double().unsqueeze(-1))
    g_out = dout.double()
    delta = (g_out * out.double()).sum(-1).transpose(1, 2)
    dprobs = torch.einsum("bqhd,bkhd->bhqk", g_out, vv)
    dscores = probs * (dprobs - delta.unsqueeze(-1)) * softmax_scale
    hkv = k.shape[2]
    dq.copy_(torch.einsum("bhqk,bkhd->bqhd", dscores, kk))
    dk.copy_(torch.einsum("bhqk,bqhd->bkhd", dscores, q.double()).reshape(b, -1, hkv, hq // hkv, d).sum(3))
    dv.copy_(torch.einsum("bhqk,bqhd->bkhd", probs, g_out).reshape(b, -1, hkv, hq // hkv, d).sum(3))
    return delta.float()


@torch.library.custom_op("megatron_ring_standin::flash_attn_backward", mutates_args=("dq", "dk", "dv"))
def _backward_v27(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  softmax_lse: torch.Tensor, dq: Optional[torch.Tensor], dk: Optional[torch.Tensor],
                  dv: Optional[torch.Tensor], dropout_p: float, softmax_scale: float, causal: bool,
                  window_size_left: int, window_size_right: int, softcap: float,
                  alibi_slopes: Optional[torch.Tensor], deterministic: bool,
                  rng_state: Optional[torch.Tensor] = None) -> torch.Tensor:
    _check("plain attention", (window_size_left, window_size_right) == (-1, -1) and softcap == 0.0
           and alibi_slopes is None)
    return _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal)


def _backward_v26(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size, softcap,
                  alibi_slopes, deterministic, rng_state=None):
    _check("plain attention", tuple(window_size) == (-1, -1) and softcap == 0.0 and alibi_slopes is None)
    return _backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal)


def modules(version: str) -> dict[str, types.ModuleType]:
    """``sys.modules`` entries for a stand-in of flash-attn ``version`` ("2.7.4.post1", "2.6.3", ...)."""
    package = types.ModuleType("flash_attn")
    package.__version__ = version
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    interface.flash_attn_func = flash_attn_func
    interface._flash_attn_backward = _backward_v27 if tuple(map(int, version.split(".")[:2])) >= (2, 7) else _backward_v26
    package.flash_attn_interface = interface
    return {"flash_attn": package, "flash_attn.flash_attn_interface": interface}

