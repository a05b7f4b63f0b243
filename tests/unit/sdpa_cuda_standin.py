"""A CPU stand-in for the CUDA attention ops the ``sdpa`` backend calls, to check its calls without a GPU.

It exposes ``_scaled_dot_product_{cudnn,flash,efficient}_attention`` and their backwards with the
op schemas of torch's CUDA build, enforces the checks the CUDA code makes on what we pass (q/k/v
dtype, equal head counts, unit last stride, 8-element-aligned head and batch strides; a bias of
exactly ``[b, h, q, k]`` in q's dtype with a unit last stride and 8-aligned other strides, stride
0 allowed; the efficient backward's lse ``[b, h, >= q]`` fp32 with 8-aligned head and batch
strides; cuDNN's lse ``[b, h, q, 1]``) and computes in float64: the backward from the lse it is
given, a query that sees no key gets a NaN output. It is not torch's CUDA build: only a GPU run
checks the kernels (the prepared device check, megatron_ring/perf/bench/device_checks.py).
"""
from __future__ import annotations

import math

import torch


def _check(name: str, cond: bool) -> None:
    if not cond:
        raise RuntimeError(f"CUDA op stand-in: {name}")


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    _check("fp16/bf16", q.dtype in (torch.float16, torch.bfloat16) and k.dtype == v.dtype == q.dtype)
    for t in (q, k, v):
        _check("4-D, unit last stride", t.dim() == 4 and t.stride(-1) == 1)
        _check("8-aligned head and batch strides", t.stride(0) % 8 == 0 and t.stride(1) % 8 == 0)
    _check("same heads (no GQA)", q.shape[1] == k.shape[1] == v.shape[1])
    _check("k, v shapes", k.shape == v.shape and k.shape[0] == q.shape[0] and k.shape[3] == q.shape[3])


def _check_bias(bias: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> None:
    if bias is None:
        return
    _check("bias dtype = q dtype", bias.dtype == q.dtype)
    _check("bias [b, h, q, k]", tuple(bias.shape) == (q.shape[0], q.shape[1], q.shape[2], k.shape[2]))
    _check("bias unit last stride", bias.stride(3) == 1)
    _check("bias 8-aligned strides", all(s % 8 == 0 for s in bias.stride()[:3]))


def _scores(q, k, bias, causal, scale) -> torch.Tensor:
    scores = q.double() @ k.double().transpose(-1, -2) * scale
    if bias is not None:
        scores = scores + bias.double()
    if causal:  # top-left: query i sees keys 0..i
        scores = scores.masked_fill(torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).triu_(1), float("-inf"))
    return scores


def _forward(q, k, v, bias, causal, scale):
    _check_qkv(q, k, v)
    _check_bias(bias, q, k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = _scores(q, k, bias, causal, scale)
    lse = torch.logsumexp(scores, -1)
    return (torch.exp(scores - lse[..., None]) @ v.double()).to(q.dtype), lse.float()


def _backward(dout, q, k, v, bias, out, lse, causal, scale):
    _check_qkv(q, k, v)
    _check_bias(bias, q, k)
    _check("finite lse", bool(torch.isfinite(lse).all()))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    probs = torch.exp(_scores(q, k, bias, causal, scale) - lse.double()[..., None])
    g = dout.double()
    delta = (g * out.double()).sum(-1, keepdim=True)
    dscores = probs * (g @ v.double().transpose(-1, -2) - delta) * scale
    return ((dscores @ k.double()).to(q.dtype), (dscores.transpose(-1, -2) @ q.double()).to(q.dtype),
            (probs.transpose(-1, -2) @ g).to(q.dtype))


class CudaOps:
    """The ops, as attributes of ``torch.ops.aten`` are; ``calls`` records the names called."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def _scaled_dot_product_efficient_attention(self, q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0,
                                                is_causal=False, *, scale=None):
        self.calls.append("efficient")
        _check("lse, no dropout", compute_log_sumexp and dropout_p == 0.0)
        out, lse = _forward(q, k, v, attn_bias, is_causal, scale)
        padded = torch.zeros(*lse.shape[:2], 32 * math.ceil(lse.shape[2] / 32))
        padded[..., :lse.shape[2]] = lse
        return out, padded, torch.empty((), dtype=torch.int64), torch.empty((), dtype=torch.int64)

    def _scaled_dot_product_efficient_attention_backward(self, grad_out, q, k, v, attn_bias, out, logsumexp,
                                                         philox_seed, philox_offset, dropout_p, grad_input_mask,
                                                         is_causal=False, *, scale=None):
        self.calls.append("efficient_backward")
        _check("no dropout, no bias gradient", dropout_p == 0.0 and list(grad_input_mask) == [True, True, True, False])
        _check("lse fp32 [b, h, >= q]", logsumexp.dtype == torch.float32 and logsumexp.dim() == 3
               and tuple(logsumexp.shape[:2]) == tuple(q.shape[:2]) and logsumexp.shape[2] >= q.shape[2])
        _check("lse 8-aligned strides", logsumexp.stride(0) % 8 == 0 and logsumexp.stride(1) % 8 == 0)
        grads = _backward(grad_out, q, k, v, attn_bias, out, logsumexp[..., :q.shape[2]], is_causal, scale)
        return (*grads, None)

    def _scaled_dot_product_cudnn_attention(self, q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0,
                                            is_causal=False, return_debug_mask=False, *, scale=None):
        self.calls.append("cudnn")
        _check("lse, no dropout", compute_log_sumexp and dropout_p == 0.0 and not return_debug_mask)
        out, lse = _forward(q, k, v, attn_bias, is_causal, scale)
        return out, lse[..., None], None, None, q.shape[2], k.shape[2], None, None, None

    def _scaled_dot_product_cudnn_attention_backward(self, grad_out, q, k, v, out, logsumexp, philox_seed,
                                                     philox_offset, attn_bias, cum_seq_q, cum_seq_k, max_q, max_k,
                                                     dropout_p, is_causal, *, scale=None):
        self.calls.append("cudnn_backward")
        _check("dense, no dropout", cum_seq_q is None and cum_seq_k is None and dropout_p == 0.0
               and (max_q, max_k) == (q.shape[2], k.shape[2]))
        _check("lse fp32 [b, h, q, 1]", logsumexp.dtype == torch.float32
               and tuple(logsumexp.shape) == (*q.shape[:3], 1))
        return _backward(grad_out, q, k, v, attn_bias, out, logsumexp[..., 0], is_causal, scale)

    def _scaled_dot_product_flash_attention(self, q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False,
                                            *, scale=None):
        self.calls.append("flash")
        _check("no dropout", dropout_p == 0.0 and not return_debug_mask)
        out, lse = _forward(q, k, v, None, is_causal, scale)
        return out, lse, None, None, q.shape[2], k.shape[2], None, None, None

    def _scaled_dot_product_flash_attention_backward(self, grad_out, q, k, v, out, logsumexp, cum_seq_q, cum_seq_k,
                                                     max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset,
                                                     *, scale=None):
        self.calls.append("flash_backward")
        _check("dense, no dropout", cum_seq_q is None and cum_seq_k is None and dropout_p == 0.0)
        _check("lse fp32 [b, h, q]", logsumexp.dtype == torch.float32 and tuple(logsumexp.shape) == tuple(q.shape[:3]))
        return _backward(grad_out, q, k, v, None, out, logsumexp, is_causal, scale)
