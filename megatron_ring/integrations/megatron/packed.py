"""Packed (THD) batches for Megatron: documents in one row, sharded per document over the CP group.

Note [THD layout under CP]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Megatron packs several documents into one row (``qkv_format="thd"``: ``[tokens, heads, dim]``,
batch 1) and describes them by ``PackedSeqParams``: ``cu_seqlens_q/kv`` are the documents'
boundaries, ``cu_seqlens_q/kv_padded`` the boundaries after each document was padded at its end
to a multiple of ``2 * cp`` (its tokens sit at the padded offsets). Each document is split zigzag
on its own, exactly as Transformer Engine's ``thd_get_partitioned_indices``: rank r keeps
chunks r and 2P-1-r of every document, in document order::

    docs A (8 tokens), B (4 tokens), cp = 2: chunks A0..A3 (2 tokens each), B0..B3 (1 token each)
    rank 0: A0 A3 B0 B3        rank 1: A1 A2 B1 B2

Megatron's THD RoPE (``_apply_rotary_pos_emb_thd``) already rotates every local token at its
position inside its own document under this split, so :class:`RingAttention` only hands the
padded boundaries to ``ring_attention(..., cu_seqlens=)``: attention never crosses documents.
The padding tokens at a document's end come after all its real tokens, so under the causal mask no
real token sees them; their own outputs are set to 0 (they carry no loss). Without the causal
mask they would be visible, so they are masked as keys.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_ring.attention.sharding import shard_sequence

QKV_FORMATS: tuple[str, ...] = ("thd",)
"""``PackedSeqParams.qkv_format`` values RingAttention implements."""


@dataclass(frozen=True)
class THDLayout:
    """What the ring needs from ``PackedSeqParams``.

    ``cu_seqlens``: int32 ``[n_docs + 1]``, the (padded) global boundaries of the local tokens'
    layout. ``real``: bool ``[tokens_local]``, True for real tokens, or None when no document is padded.
    """

    cu_seqlens: torch.Tensor
    real: Optional[torch.Tensor]


def _cu(name: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.numel() < 2 or value.is_floating_point():
        raise ValueError(f"packed_seq_params.{name} must be an integer tensor [n_docs + 1], got "
                         f"{getattr(value, 'shape', type(value).__name__)}")
    return value


def thd_layout(params: PackedSeqParams, tokens_local: int, cp_rank: int, cp_size: int,
               cp_group: Any) -> THDLayout:
    """Check ``params`` (self-attention THD, this CP group) and return the local layout.

    ``tokens_local`` is the local query length; the padded boundaries must add up to
    ``tokens_local * cp_size``. Each error names the field, its value and what is allowed.
    """
    fmt = getattr(params, "qkv_format", None)
    if fmt not in QKV_FORMATS:
        raise ValueError(f"packed_seq_params.qkv_format = {fmt!r} is not supported by RingAttention; "
                         f"allowed: {list(QKV_FORMATS)}")
    if getattr(params, "local_cp_size", None) is not None:
        raise ValueError(f"packed_seq_params.local_cp_size = {params.local_cp_size} (hybrid context parallelism) "
                         "is not supported by RingAttention; allowed: None")
    if getattr(params, "cp_group", None) is not None and params.cp_group is not cp_group:
        raise ValueError("packed_seq_params.cp_group is not RingAttention's CP group; allowed: None or that group")
    cu_q, cu_kv = _cu("cu_seqlens_q", params.cu_seqlens_q), _cu("cu_seqlens_kv", params.cu_seqlens_kv)
    pad_q = cu_q if params.cu_seqlens_q_padded is None else _cu("cu_seqlens_q_padded", params.cu_seqlens_q_padded)
    pad_kv = cu_kv if params.cu_seqlens_kv_padded is None else _cu("cu_seqlens_kv_padded", params.cu_seqlens_kv_padded)
    for name, a, b in (("cu_seqlens_kv", cu_kv, cu_q), ("cu_seqlens_kv_padded", pad_kv, pad_q)):
        if a.shape != b.shape or not torch.equal(a.cpu(), b.cpu()):
            raise ValueError(f"packed_seq_params.{name} = {a.tolist()} differs from its q counterpart {b.tolist()}; "
                             "RingAttention supports self-attention only (equal q and kv boundaries)")
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_q_padded", pad_q)):
        backwards = ((cu[1:] - cu[:-1]) < 0).nonzero().flatten().tolist()
        if backwards:
            at = backwards[0]
            raise ValueError(f"packed_seq_params.{name} = {cu.tolist()} must be non-decreasing: {name}[{at}] = "
                             f"{int(cu[at])} > {name}[{at + 1}] = {int(cu[at + 1])}")
    lengths, padded = (cu_q[1:] - cu_q[:-1]).cpu(), (pad_q[1:] - pad_q[:-1]).cpu()
    if bool((lengths > padded).any()):
        raise ValueError(f"packed_seq_params.cu_seqlens_q = {cu_q.tolist()} does not fit inside "
                         f"cu_seqlens_q_padded = {pad_q.tolist()}; every document must be at most its padded length")
    if int(pad_q[0]) != 0 or int(pad_q[-1]) != tokens_local * cp_size:
        name = "cu_seqlens_q" if params.cu_seqlens_q_padded is None else "cu_seqlens_q_padded"
        raise ValueError(f"packed_seq_params.{name} = {pad_q.tolist()} ends at {int(pad_q[-1])} but the CP group holds "
                         f"{tokens_local} x {cp_size} = {tokens_local * cp_size} tokens; pass global boundaries from 0")
    cu = pad_q.to(torch.int32)
    real = None
    if not torch.equal(lengths, padded):
        index = torch.arange(int(pad_q[-1]))
        doc = torch.bucketize(index, pad_q.cpu()[1:], right=True)
        real = index - pad_q.cpu()[doc] < lengths[doc]
        real = shard_sequence(real, cp_rank, cp_size, dim=0, cu_seqlens=cu.cpu()) if cp_size > 1 else real
    return THDLayout(cu, real)


def pack_documents(docs: Sequence[Mapping[str, torch.Tensor]], multiple: int,
                   pad: Optional[Mapping[str, int]] = None) -> tuple[dict[str, torch.Tensor], PackedSeqParams]:
    """Pack documents into one THD row, each padded at its end to a multiple of ``multiple`` (``2 * cp``).

    ``docs``: per document, tensors whose first dim is its length, under the same keys (``tokens``,
    ``labels``, ...: ``[n]``; anything ``[n, ...]``); ``pad`` gives each key's padding value (default 0). Adds ``position_ids`` (restarting at
    0 in every document, continuing through its padding) and ``loss_mask`` (1.0 on real tokens)
    unless given. Returns the ``[1, total]`` batch and its ``PackedSeqParams`` (global boundaries).
    """
    if not docs:
        raise ValueError("docs must hold at least one document")
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
        raise ValueError(f"multiple must be an int >= 1, got {multiple!r}")
    pad = dict(pad or {})
    lengths = [next(iter(doc.values())).shape[0] for doc in docs]
    padded = [-(-n // multiple) * multiple for n in lengths]
    rows: dict[str, list[torch.Tensor]] = {}
    for doc, n, p in zip(docs, lengths, padded):
        fields = dict(doc)
        fields.setdefault("position_ids", torch.arange(n))
        fields.setdefault("loss_mask", torch.ones(n))
        for key, value in fields.items():
            if value.dim() == 0 or value.shape[0] != n:
                raise ValueError(f"docs: {key!r} has shape {tuple(value.shape)}, expected ({n}, ...) like the other keys")
            fill = torch.arange(n, p) if key == "position_ids" else \
                value.new_full((p - n, *value.shape[1:]), pad.get(key, 0))
            rows.setdefault(key, []).append(torch.cat([value, fill.to(value.dtype)]))
    batch = {key: torch.cat(parts)[None] for key, parts in rows.items()}
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cu_padded = torch.tensor([0, *torch.tensor(padded).cumsum(0).tolist()], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
                             cu_seqlens_kv_padded=cu_padded, max_seqlen_q=max(padded), max_seqlen_kv=max(padded))
    return batch, params


def packed_seq_params(cu_seqlens_padded: Optional[torch.Tensor]) -> Optional[PackedSeqParams]:
    """Self-attention THD params of a row whose documents already end in their padding (padding counted as
    part of each document: under the causal mask no real token sees it, and it carries no loss); None for None."""
    if cu_seqlens_padded is None:
        return None
    cu = cu_seqlens_padded.to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                           cu_seqlens_kv_padded=cu, max_seqlen_q=longest, max_seqlen_kv=longest)


def get_thd_batch_on_this_cp_rank(batch: Mapping[str, Optional[torch.Tensor]], cu_seqlens_padded: torch.Tensor, *,
                                  cp_rank: Optional[int] = None,
                                  cp_size: Optional[int] = None) -> dict[str, Optional[torch.Tensor]]:
    """This CP rank's part of a packed ``[1, total]`` batch: every document split zigzag on its own.

    The same split as Megatron's ``get_thd_batch_on_this_cp_rank`` (Transformer Engine's
    ``thd_get_partitioned_indices``), without Transformer Engine. ``cu_seqlens_padded``: the
    global int32 boundaries, each document a multiple of ``2 * cp_size`` long. ``cp_rank`` /
    ``cp_size`` default to Megatron's parallel_state. None values stay None.
    """
    if cp_rank is None or cp_size is None:
        cp_rank = parallel_state.get_context_parallel_rank() if cp_rank is None else cp_rank
        cp_size = parallel_state.get_context_parallel_world_size() if cp_size is None else cp_size
    if cp_size == 1:
        return dict(batch)
    return {key: None if val is None else shard_sequence(val, cp_rank, cp_size, dim=1, cu_seqlens=cu_seqlens_padded)
            for key, val in batch.items()}
