"""Block kernels from the flash-attn package (FlashAttention-2) on CUDA.

The core works in ``[batch, heads, seq, head_dim]`` (BHSD) views whose memory is ``[batch, seq, heads, head_dim]``
(BSHD), the package's layout: the views are handed over transposed back, which costs no copy because the package only
needs unit stride on ``head_dim``. K/V keep their ``heads_kv`` heads (the package does GQA, dK/dV per K/V head).

Note [flash-attn's backward with the merged log-sum-exp]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The public ``flash_attn_func`` differentiates one block on its own softmax. The ring needs each block's share of the
*global* softmax, so backward calls the package's ``_flash_attn_backward`` with the merged ``out`` and ``lse``
(block_backward's contract). Its leading arguments have kept their order since 2.4; the tail changed (``window_size``
became ``window_size_left``/``_right`` and ``softcap`` arrived in 2.6/2.7), so the tail is passed by name, read from the
function's own signature. Forward uses the public ``flash_attn_func(..., return_attn_probs=True)``, which returns
``(out, lse, _)`` in every 2.x release. flash-attn declares q, k, v mutated by its forward op, so torch bumps their
autograd version counters exactly as when calling ``flash_attn_func`` directly; the ring saves its tensors after the
last forward call, so its own backward is unaffected.
"""
from __future__ import annotations

import functools
import inspect
from types import ModuleType
from typing import Any, Callable

import torch

MIN_VERSION: tuple[int, int] = (2, 6)
"""Oldest flash-attn 2 release taken; 3.x is another interface and is not taken."""


@functools.lru_cache(maxsize=1)
def _load() -> ModuleType | str:
    """``flash_attn.flash_attn_interface``, or why it cannot be used (import once per process)."""
    try:
        import flash_attn
        from flash_attn import flash_attn_interface
    except (ImportError, OSError) as err:
        if isinstance(err, ModuleNotFoundError) and err.name == "flash_attn":
            return "the flash-attn package is not installed (pip install flash-attn)"
        return f"flash-attn cannot be imported: {err}"
    try:  # "2.7.4.post1" -> (2, 7); unparsable -> (0, 0)
        major, minor = (int(x) for x in getattr(flash_attn, "__version__", "0").split(".")[:2])
    except ValueError:
        major, minor = 0, 0
    if (major, minor) < MIN_VERSION or major != MIN_VERSION[0]:
        return (f"flash-attn {flash_attn.__version__} is not a 2.x release from "
                f"{'.'.join(map(str, MIN_VERSION))} on")
    return flash_attn_interface


def flash_attn_problem(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the package cannot run these inputs, or None when it can."""
    if device.type != "cuda":
        return f"it runs on CUDA only, got device={device}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"it takes float16/bfloat16, got dtype={dtype}"
    if head_dim % 8 or head_dim > 256:
        return f"it takes head_dim a multiple of 8 up to 256, got head_dim={head_dim}"
    loaded = _load()
    if isinstance(loaded, str):
        return loaded
    major, minor = torch.cuda.get_device_capability(device)
    if not (major == 8 or (major, minor) == (9, 0)):  # FlashAttention-2's kernels: sm_8x and sm_90
        return f"it needs an sm_8x or sm_90 GPU, got {torch.cuda.get_device_name(device)} (sm_{major}{minor})"
    return None


def _interface() -> ModuleType:
    loaded = _load()
    if isinstance(loaded, str):
        raise RuntimeError(f"backend 'flash_attn' is unusable: {loaded}")
    return loaded


@functools.lru_cache(maxsize=4)
def _backward_tail(fn: Callable[..., Any]) -> dict[str, Any]:
    """The version-dependent keyword arguments of ``_flash_attn_backward`` for plain attention
    (read once per function, not on every ring step; the dict is never mutated)."""
    names = set(inspect.signature(getattr(fn, "_init_fn", fn)).parameters)  # >= 2.7: a custom_op keeps it as _init_fn
    tail: dict[str, Any] = {"alibi_slopes": None, "deterministic": False}
    if "window_size_left" in names:
        tail.update(window_size_left=-1, window_size_right=-1)
    elif "window_size" in names:
        tail["window_size"] = (-1, -1)
    if "softcap" in names:
        tail["softcap"] = 0.0
    if "rng_state" in names:
        tail["rng_state"] = None
    unknown = set(tail) - names
    if unknown:
        raise RuntimeError(f"flash-attn's _flash_attn_backward lacks {sorted(unknown)}; this flash-attn is unsupported")
    return tail


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[b, hq, sq, d]``, k/v ``[b, hkv, sk, d]`` -> ``(out [b, hq, sq, d] in q's dtype, lse [b, hq, sq] fp32)``."""
    out, lse, _ = _interface().flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=0.0, softmax_scale=scale,
        causal=causal, return_attn_probs=True,
    )
    return out.transpose(1, 2), lse[..., : q.shape[2]]


def flash_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, *, causal: bool,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's gradients from the merged ``out``/``lse`` (Note above), BHSD in q's dtype."""
    backward = _interface()._flash_attn_backward
    b, hq, sq, d = q.shape
    _, hkv, sk, _ = k.shape
    dq = torch.empty(b, sq, hq, d, dtype=q.dtype, device=q.device)
    dk = torch.empty(b, sk, hkv, d, dtype=q.dtype, device=q.device)
    dv = torch.empty(b, sk, hkv, d, dtype=q.dtype, device=q.device)
    backward(
        dout.to(q.dtype).transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        out.to(q.dtype).transpose(1, 2), lse.float().contiguous(), dq, dk, dv,
        dropout_p=0.0, softmax_scale=scale, causal=causal, **_backward_tail(backward),
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
