"""Boundary checks for the attention entry points: clear TypeError/ValueError, never a deep torch error."""
from __future__ import annotations

import torch

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_qkv(q: object, k: object, v: object, *, same_seq: bool) -> None:
    """Validate ``[batch, seq, heads, head_dim]`` q/k/v (``same_seq``: q and k/v share seq length)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, seq, heads, head_dim], got shape {tuple(t.shape)}")
        if t.dtype not in DTYPES:
            raise TypeError(f"{name}.dtype is {t.dtype}; allowed: {[str(d) for d in DTYPES]}")
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k, v must share a dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k, v must be on one device, got q={q.device}, k={k.device}, v={v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k={tuple(k.shape)}, v={tuple(v.shape)}")
    for name, t, dim, field in (("q", q, 2, "heads_q"), ("k", k, 2, "heads_kv"), ("q", q, 3, "head_dim")):
        if t.shape[dim] == 0:
            raise ValueError(f"{name} has {field} = 0; {field} must be >= 1")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"batch mismatch: q has {q.shape[0]}, k/v have {k.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"head_dim mismatch: q has {q.shape[3]}, k/v have {k.shape[3]}")
    if same_seq and q.shape[1] != k.shape[1]:
        raise ValueError(f"seq_local mismatch: q has {q.shape[1]}, k/v have {k.shape[1]}; the ring needs equal local lengths")
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"heads_q ({q.shape[2]}) must be divisible by heads_kv ({k.shape[2]}) for grouped-query attention"
        )


def check_tokens(q: torch.Tensor, seq_name: str, entry: str, rule: str) -> None:
    """Raise ValueError if q ``[batch, seq, heads, head_dim]`` has no token (``seq_name`` = 0)."""
    if q.shape[1] == 0:
        raise ValueError(f"q has {seq_name} = 0; {entry} needs {rule} ({seq_name} >= 1)")


def check_key_padding_mask(mask: object, k: torch.Tensor) -> None:
    """Validate a key padding mask: None, or bool ``[batch, seq]`` matching k's batch, seq and device."""
    if mask is None:
        return
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"key_padding_mask must be a torch.Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"key_padding_mask.dtype is {mask.dtype}; allowed: torch.bool (True = a real token)")
    if tuple(mask.shape) != (k.shape[0], k.shape[1]):
        raise ValueError(f"key_padding_mask must be [batch, seq] = {(k.shape[0], k.shape[1])} like k, "
                         f"got shape {tuple(mask.shape)}")
    if mask.device != k.device:
        raise ValueError(f"key_padding_mask must be on k's device {k.device}, got {mask.device}")


def check_choice(name: str, value: object, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")
    return value  # type: ignore[return-value]


def check_cu_seqlens(cu_seqlens: object, total_tokens: int) -> tuple[int, ...]:
    """The document lengths of packed boundaries ``cu_seqlens`` (int32 ``[n_docs + 1]``, from 0 to
    ``total_tokens``, non-decreasing); TypeError/ValueError naming ``cu_seqlens`` otherwise.

    Reads the values to the host (one device synchronisation when they live on a GPU).
    """
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be an int32 torch.Tensor [n_docs + 1] or None, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens.dtype is {cu_seqlens.dtype}; allowed: torch.int32")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D [n_docs + 1] with n_docs >= 1, got shape {tuple(cu_seqlens.shape)}")
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens[0] = {bounds[0]}")
    lengths = tuple(b - a for a, b in zip(bounds, bounds[1:]))
    if min(lengths) < 0:
        at = next(i for i, n in enumerate(lengths) if n < 0)
        raise ValueError(f"cu_seqlens must be non-decreasing, got cu_seqlens[{at}] = {bounds[at]} > "
                         f"cu_seqlens[{at + 1}] = {bounds[at + 1]}")
    if bounds[-1] != total_tokens:
        raise ValueError(f"cu_seqlens[-1] = {bounds[-1]} must equal the global packed token count {total_tokens} "
                         "(tokens_local x cp)")
    return lengths
