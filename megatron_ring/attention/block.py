"""Attention of one query block over one key/value block, with its log-sum-exp; the fp32 log-sum-exp merge of results.

Layout inside the core is ``[batch, heads, seq, head_dim]`` (BHSD). Queries have ``heads_q`` heads, keys/values
``heads_kv``; ``heads_q % heads_kv == 0`` (GQA/MQA). K/V are never repeated in memory (Note [GQA without repeats]).

Backends:

* ``"math"``: pure torch, always available, scores and softmax in fp32 (fp64 for fp64 inputs).
* ``"sdpa"``: torch's fused kernels, which return the log-sum-exp the ring needs, with their fused backward
  (sdpa_backend.py: which kernel on which device); on CUDA fp16/bf16 and head_dim a multiple of 8 up to 256.
* ``"flash_attn"``: the flash-attn package (FlashAttention-2, >= 2.6) on CUDA, fp16/bf16, head_dim a multiple of 8 up to
  256, sm_8x and sm_90; native GQA, so K/V are never repeated (flash_attn_backend.py).
* ``"auto"``: on CUDA before Hopper ``"flash_attn"`` when the package is installed and takes the inputs (unmasked calls
  only); otherwise ``"sdpa"`` where its kernels take them (cuDNN on Hopper), ``"math"`` elsewhere.

The CUDA paths follow the op schemas of torch's CUDA build and flash-attn's interface; CI has no GPU, so
tests/unit/test_flash_attn_backend.py and test_sdpa_backend.py check them against CPU stand-ins (and float64 on a GPU).

Note [GQA without repeats]
~~~~~~~~~~~~~~~~~~~~~~~~~~
torch's fused kernels want as many K/V heads as query heads, and repeating K/V copies the whole block
``heads_q / heads_kv`` times, which in decode (one query, a long cache shard) costs more than the attention itself. A
block without a causal mask (every off-diagonal ring block, every decode step) does not need it: the
``g = heads_q / heads_kv`` query heads of one K/V head are folded into the query-length axis,
``[b, hq, s, d] -> [b, hkv, g * s, d]`` (query head ``h`` uses K/V head ``h // g``), the kernel runs on ``hkv`` heads,
and out/lse unfold back. dK/dV then come out already summed over the group. Folding would break the causal diagonal
block's position-based mask, so there ``sdpa`` makes one kernel call per head slice ``q[:, j::g]`` (query heads
``j, j + g, ...`` use K/V heads ``0, 1, ...``: as many as K/V has), writing into one output, and sums dK/dV over the
slices; one slice's output is alive beside the whole (``1 + 1/g`` times the output). ``math`` groups heads in matmuls.

``causal=True`` is only used for the diagonal block (``q_len == k_len``, same positions): query i sees keys 0..i.

``key_mask`` (bool ``[batch, k_len]``, True = a real key, False = padding) hides keys from every query; a query that
sees no key at all gets ``lse = -inf`` and a zero output (weight 0 in the merge). ``visible`` (bool ``[q_len, k_len]``,
True = the query may see the key: a sliding window's band, or decode's positions) hides pairs the same way and combines
with both. ``math`` and ``sdpa`` take masks (``sdpa`` as an additive bias, never an ``Lq x Lk`` matrix of floats:
Note [Masks as a bias, tile by tile] in sdpa_backend.py), ``flash_attn`` does not; ``resolve_backend`` with
``masked=True`` picks or checks accordingly. The GQA fold takes a ``visible`` mask (repeated over the folded heads).

Note [Log-sum-exp merge]
~~~~~~~~~~~~~~~~~~~~~~~~
Attention of a query over keys split into blocks A and B is recoverable from the per-block
results. With ``lse_X = log sum_{j in X} exp(s_j)`` and ``o_X = softmax_X(s) @ V_X``::

    lse = logaddexp(lse_A, lse_B)
    o   = o_A * exp(lse_A - lse) + o_B * exp(lse_B - lse)

The weights are in (0, 1], so the merge never overflows. We keep ``o`` and ``lse`` in fp32 whatever the input dtype: a
bf16 accumulator would lose ~3 significant digits per ring step. A block in which a query sees no key has
``lse = -inf``; ``-inf - -inf`` is NaN, so the weights are computed with the -inf rows forced to weight 0 instead.
"""
from __future__ import annotations

import torch

from megatron_ring.attention.flash_attn_backend import flash_attn_problem, flash_backward, flash_forward
from megatron_ring.attention.sdpa_backend import kernel_for, sdpa_backward, sdpa_forward, without_neginf

BACKENDS: tuple[str, ...] = ("auto", "math", "sdpa", "flash_attn")


def _sdpa_takes(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether torch's fused flash kernel for ``device`` accepts these inputs."""
    if device.type == "cpu":
        return True
    return device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and head_dim % 8 == 0 and head_dim <= 256


_CPU_KERNEL_TAKES_A_MASK = torch.torch_version.TorchVersion(torch.__version__) >= "2.5"
"""Before torch 2.5 the CPU flash kernel returned NaN for rows whose first key block (512 keys) was
all masked, so older torch uses ``math`` with a mask."""


def _sdpa_takes_a_mask(device: torch.device) -> bool:
    """Whether the ``sdpa`` kernels on ``device`` apply a mask (an additive bias; sdpa_backend.py)."""
    return device.type == "cuda" or (device.type == "cpu" and _CPU_KERNEL_TAKES_A_MASK)


def resolve_backend(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int, *,
                    masked: bool = False) -> str:
    """The concrete backend for ``backend`` and these inputs (``masked``: blocks may carry a mask, a key padding mask or
    a window's); ValueError for an unknown or unusable one."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    if masked:
        if backend == "flash_attn" or (backend == "sdpa" and not _sdpa_takes_a_mask(device)):
            raise ValueError(f"backend {backend!r} cannot take a key_padding_mask on device={device} with torch "
                             f"{torch.__version__}, nor a window_size; use 'math' or 'auto' (which picks 'sdpa' where "
                             "its kernels take a mask: CPU with torch >= 2.5, CUDA fp16/bf16)")
        if backend == "auto":
            return "sdpa" if _sdpa_takes_a_mask(device) and _sdpa_takes(device, dtype, head_dim) else "math"
    if backend == "auto":
        # flash_attn_problem is None only on CUDA, so the capability query is safe.
        if device.type == "cuda" and flash_attn_problem(device, dtype, head_dim) is None \
                and kernel_for(device, masked=False) == "flash":
            return "flash_attn"
        return "sdpa" if _sdpa_takes(device, dtype, head_dim) else "math"
    if backend == "flash_attn":
        problem = flash_attn_problem(device, dtype, head_dim)
        if problem is not None:
            raise ValueError(f"backend 'flash_attn' cannot take device={device}, dtype={dtype}, "
                             f"head_dim={head_dim}: {problem}; use 'sdpa', 'math' or 'auto'")
    if backend == "sdpa" and not _sdpa_takes(device, dtype, head_dim):
        raise ValueError(
            f"backend 'sdpa' cannot take device={device}, dtype={dtype}, head_dim={head_dim}: on CUDA it needs "
            "fp16/bf16 and head_dim a multiple of 8 up to 256; use 'math' or 'auto'"
        )
    return backend


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def grouped(q: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """``[b, hq, s, d]`` -> ``[b, hkv, hq/hkv, s, d]`` (a view): query head ``h`` under K/V head ``h // (hq/hkv)``."""
    b, hq, s, d = q.shape
    return q.reshape(b, heads_kv, hq // heads_kv, s, d)


def _causal_mask(q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
    """True where query i must not see key j (j > i)."""
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).triu_(1)


def _math_scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float,
                 key_mask: torch.Tensor | None, visible: torch.Tensor | None) -> torch.Tensor:
    """Scaled scores ``[b, hkv, g, q, k]`` in the compute dtype, masked with -inf."""
    ct = compute_dtype(q.dtype)
    scores = torch.matmul(grouped(q, k.shape[1]).to(ct), k.to(ct).unsqueeze(2).transpose(-1, -2)) * scale
    if causal:
        scores.masked_fill_(_causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    if key_mask is not None:
        scores.masked_fill_(~key_mask[:, None, None, None, :], float("-inf"))
    if visible is not None:
        scores.masked_fill_(~visible, float("-inf"))
    return scores


def _check_mask_backend(masked: bool, backend: str, device: torch.device) -> None:
    """A mask reaches only the kernels that apply it (resolve_backend(masked=True) picks them)."""
    if masked and not (backend == "math" or (backend == "sdpa" and _sdpa_takes_a_mask(device))):
        raise ValueError(f"backend {backend!r} on {device} cannot apply a key mask or a visibility mask; "
                         "resolve it with masked=True")


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float,
                  backend: str, key_mask: torch.Tensor | None = None,
                  visible: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q ``[b, hq, sq, d]`` over k, v ``[b, hkv, sk, d]`` (masks: module docstring):
    ``(out [b, hq, sq, d], lse [b, hq, sq])``: lse fp32 (fp64 for fp64), out in the compute dtype (math) or q's."""
    _check_mask_backend(key_mask is not None or visible is not None, backend, q.device)
    if backend != "math":
        out, lse = flash_forward(q, k, v, causal=causal, scale=scale) if backend == "flash_attn" else \
            sdpa_forward(q, k, v, causal=causal, scale=scale, key_mask=key_mask, visible=visible)
        return out, lse.to(compute_dtype(q.dtype))
    scores = _math_scores(q, k, causal, scale, key_mask, visible)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - without_neginf(lse).unsqueeze(-1))
    out = torch.matmul(probs, v.to(scores.dtype).unsqueeze(2))
    b, hq, sq, d = q.shape
    return out.reshape(b, hq, sq, v.shape[-1]), lse.reshape(b, hq, sq)


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, *, causal: bool, scale: float, backend: str,
                   key_mask: torch.Tensor | None = None,
                   visible: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block given the *final* (merged) ``out`` and ``lse`` of these queries: with the final lse,
    ``exp(s - lse)`` is exactly this block's slice of the global softmax, so the block's dq/dk/dv are its exact share of
    the global gradients. Returns ``(dq [b, hq, sq, d], dk [b, hkv, sk, d], dv [b, hkv, sk, d])``, compute dtype."""
    _check_mask_backend(key_mask is not None or visible is not None, backend, q.device)
    ct = compute_dtype(q.dtype)
    if backend != "math":
        grads = flash_backward(dout, q, k, v, out, lse, causal=causal, scale=scale) if backend == "flash_attn" else \
            sdpa_backward(dout.to(q.dtype), q, k, v, out.to(q.dtype), lse.to(ct), causal=causal, scale=scale,
                          key_mask=key_mask, visible=visible)
        return grads[0].to(ct), grads[1].to(ct), grads[2].to(ct)
    hkv = k.shape[1]
    scores = _math_scores(q, k, causal, scale, key_mask, visible)
    probs = torch.exp(scores - grouped(without_neginf(lse).to(ct).unsqueeze(-1), hkv))
    g_out = grouped(dout.to(ct), hkv)
    delta = (g_out * grouped(out.to(ct), hkv)).sum(-1, keepdim=True)
    dv = torch.matmul(probs.transpose(-1, -2), g_out).sum(2)
    dprobs = torch.matmul(g_out, v.to(ct).unsqueeze(2).transpose(-1, -2))
    dscores = probs * (dprobs - delta) * scale
    dq = torch.matmul(dscores, k.to(ct).unsqueeze(2)).reshape(q.shape)
    dk = torch.matmul(dscores.transpose(-1, -2), grouped(q.to(ct), hkv)).sum(2)
    return dq, dk, dv


def merge_weights(lse: torch.Tensor, lse_total: torch.Tensor) -> torch.Tensor:
    """``exp(lse - lse_total)``, 0 where ``lse_total`` is -inf (no key seen anywhere)."""
    safe_total = torch.where(torch.isneginf(lse_total), torch.zeros_like(lse_total), lse_total)
    return torch.exp(lse - safe_total)


def merge_into(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Merge one block's result into the running accumulators, in place. out, block_out: ``[batch, heads, q, head_dim]``
    (``out`` fp32, fp64 for fp64 inputs); lse, block_lse: ``[batch, heads, q]`` (``lse`` in ``out``'s dtype).
    ``out``/``lse`` may be views (slices along q)."""
    block_lse = block_lse.to(lse.dtype)
    new_lse = torch.logaddexp(lse, block_lse)
    keep = merge_weights(lse, new_lse).unsqueeze(-1)
    take = merge_weights(block_lse, new_lse).unsqueeze(-1)
    out.mul_(keep).addcmul_(block_out, take)  # fused: no block-sized temporary, any block_out dtype
    lse.copy_(new_lse)


def merge_stacked(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge P partial results stacked on dim 0: outs ``[P, batch, heads, q, head_dim]``, lses ``[P, batch, heads, q]``
    -> (out, lse) in fp32 (fp64 for fp64 inputs), in a fixed order: every rank that merges the same inputs gets bitwise
    the same result."""
    ct = torch.promote_types(lses.dtype, torch.float32)
    lses = lses.to(ct)
    total = torch.logsumexp(lses, dim=0)
    weights = merge_weights(lses, total.unsqueeze(0)).unsqueeze(-1)
    return (outs.to(ct) * weights).sum(dim=0), total
