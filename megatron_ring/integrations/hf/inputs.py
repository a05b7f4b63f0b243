"""Global model inputs -> this rank's zigzag shard, and sharded outputs -> global ones.

Every rank of the CP group holds the same *global* ``[batch, seq]`` tensors. A ring prefill
left-pads them to a multiple of ``2 * cp`` (padding: mask 0, position 0) and gives each rank its
zigzag shard; the global last token then sits on CP rank 0, the end of its second chunk.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from megatron_ring.attention.sharding import chunks_per_rank, shard_sequence, unshard_sequence
from megatron_ring.integrations.hf.context import SHARDING, CPContext

LAST_TOKEN_RANK = 0
"""The CP rank that holds a sharded sequence's last token (zigzag: rank r holds chunks r and 2 cp - 1 - r)."""


def check_ids(input_ids: object, attention_mask: object) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` ``[batch, seq]`` and its padding mask as int64 (all ones if None)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a 2-D tensor [batch, seq], got {getattr(input_ids, 'shape', type(input_ids))}")
    if input_ids.numel() == 0:
        raise ValueError(f"input_ids has shape {tuple(input_ids.shape)}; the ring needs batch >= 1 and seq >= 1")
    if attention_mask is None:
        return input_ids, torch.ones_like(input_ids)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must be a 2-D tensor shaped like input_ids {tuple(input_ids.shape)}, "
                         f"got {getattr(attention_mask, 'shape', type(attention_mask))}")
    return input_ids, attention_mask.long()


def generate_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """``generate``'s own positions ``[batch, seq]``: the count of real tokens so far (left padding gets 0)."""
    return (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)


def pad_id(model: PreTrainedModel) -> int:
    """The token id that fills the left padding (pad, else EOS, else 0); padding is masked, so any id is exact."""
    config = model.config.get_text_config()
    for value in (getattr(model.generation_config, "pad_token_id", None), getattr(config, "pad_token_id", None),
                  getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


def pad_left(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor, multiple: int,
             fill_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Left-pad ``[batch, seq]`` tensors to a multiple of ``multiple`` (mask 0, position 0); return the pad width."""
    pad = -input_ids.shape[1] % multiple
    if pad:
        def left(x: torch.Tensor, value: int) -> torch.Tensor:
            return torch.cat([x.new_full((x.shape[0], pad), value), x], dim=1)
        input_ids, attention_mask, position_ids = left(input_ids, fill_id), left(attention_mask, 0), left(position_ids, 0)
    return input_ids, attention_mask, position_ids, pad


def local_inputs(model: PreTrainedModel, ctx: CPContext, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 position_ids: torch.Tensor) -> tuple[dict[str, torch.Tensor | None], int]:
    """This rank's model inputs for a ring prefill of global ``[batch, seq]`` tensors, and the pad width
    (``ctx`` is marked as holding inputs cut here: ``CPContext.sharded``).

    The mask is None on every rank when the padded global mask has no padding (the attention
    function's masked path changes what the ranks exchange, so all ranks must agree).
    """
    ctx.sharded = True
    ids, mask, pos, pad = pad_left(input_ids, attention_mask, position_ids, chunks_per_rank(SHARDING) * ctx.size,
                                   pad_id(model))
    local_ids, local_mask, local_pos = (shard_sequence(t, ctx.rank, ctx.size, dim=1, sharding=SHARDING)
                                        for t in (ids, mask, pos))
    return {"input_ids": local_ids, "attention_mask": None if bool(mask.all()) else local_mask,
            "position_ids": local_pos}, pad


def local_columns(ctx: CPContext, seq_len: int, device: torch.device) -> torch.Tensor:
    """Global indices (int64 ``[seq_len // cp]``) of this rank's zigzag shard of a ``seq_len`` sequence."""
    return shard_sequence(torch.arange(seq_len, device=device)[None], ctx.rank, ctx.size, dim=1, sharding=SHARDING)[0]


def gather_seq(ctx: CPContext, local: torch.Tensor) -> torch.Tensor:
    """All-gather ``[batch, seq_local, ...]`` over the CP group and undo the zigzag -> ``[batch, seq, ...]``
    (per document when the context is packed)."""
    if ctx.size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(ctx.size)]
    dist.all_gather(parts, local.contiguous(), group=ctx.group)
    return unshard_sequence(parts, dim=1, sharding=SHARDING, cu_seqlens=ctx.cu_seqlens)


def last_token(ctx: CPContext, local: torch.Tensor) -> torch.Tensor:
    """The global last position ``[batch, 1, ...]`` of a sharded ``[batch, seq_local, ...]``, on every rank.

    Broadcast from :data:`LAST_TOKEN_RANK`, so every rank gets bitwise the same tensor.
    """
    last = local[:, -1:].contiguous()
    if ctx.size > 1:
        dist.broadcast(last, group=ctx.group, group_src=LAST_TOKEN_RANK)
    return last
