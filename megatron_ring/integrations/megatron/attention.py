"""Megatron-core integration: ring attention as the ``core_attention`` leaf of a GPT layer.

Megatron-core's own ``DotProductAttention`` refuses context parallelism (only Transformer
Engine's attention supports it, on CUDA). :class:`RingAttention` has the same constructor and
forward, so context parallelism becomes a one-line spec swap on any device::

    from megatron_ring.megatron import get_gpt_layer_ring_spec
    model = GPTModel(config, get_gpt_layer_ring_spec(), vocab_size, seq_len, ...)

Everything else in Megatron stays as it is: RoPE already rotates each CP rank's tokens at their
global zigzag positions, ``get_batch_on_this_cp_rank`` already lays batches out zigzag, and the
DP x CP gradient reduction already sums weight gradients over CP ranks. This module only
translates layouts (``[sq, b, np, hn]`` <-> ``[b, sq, np, hn]``; packed THD ``[t, np, hn]`` as is,
Note [THD layout under CP] in packed.py), maps ``config.window_size`` to the ring's window and
checks that the arguments it cannot honour are absent; the numerics live in
:func:`megatron_ring.ring_attention`.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention

from megatron_ring.attention.comms import COMMS, CPGroups
from megatron_ring.attention.api import ring_attention
from megatron_ring.attention.dilated import Pairs, check_dilation
from megatron_ring.attention.sharding import local_positions
from megatron_ring.integrations.megatron.packed import thd_layout

CP_COMM_TYPES: tuple[str, ...] = COMMS
"""Megatron ``cp_comm_type`` values RingAttention implements: all of them (``comm`` of ring_attention)."""

_CAUSAL = (AttnMaskType.causal, AttnMaskType.causal_bottom_right)
_SUPPORTED_MASKS = _CAUSAL + (AttnMaskType.no_mask,)


def _mask_names(types: tuple[AttnMaskType, ...]) -> list[str]:
    return [t.name for t in types]


class RingAttention(MegatronModule):
    """Exact attention over the CP group's global sequence; drop-in for ``DotProductAttention``.

    Layouts (np = query heads of this TP rank, ng = its K/V heads, sq = local tokens):
    query ``[sq, b, np, hn]``, key/value ``[sq, b, ng, hn]`` -> output ``[sq, b, np * hn]``.
    Packed sequences (``packed_seq_params.qkv_format == "thd"``): query ``[t, np, hn]``, key/value
    ``[t, ng, hn]`` -> ``[t, np * hn]``, t = this rank's tokens of all documents.
    Supports causal and no-mask attention, GQA/MQA, any ``softmax_scale``, sliding windows
    (``config.window_size`` on the layers that ``config.window_attn_skip_freq`` selects, as
    Megatron's ``DotProductAttention``) and every ``cp_comm_type`` (``"p2p"``, ``"all_gather"``,
    ``"a2a"``, ``"a2a+p2p"``; a list picks one per layer, by global layer number; windows and packed
    sequences need ``"p2p"`` or ``"all_gather"``). ``"a2a+p2p"`` runs over Megatron's hierarchical CP
    groups (``hierarchical_context_parallel_sizes = [a2a, ring]``, from ``pg_collection.hcp`` or
    parallel_state). With cp = 1 it is plain attention.

    ``dilation`` (a spec param: ``get_gpt_layer_ring_spec(dilation=...)``): LongNet's dilated
    attention, ``(w, r)`` pairs for every layer, or ``{layer_number: pairs or None}`` per layer
    (global layer numbers, absent = plain); not with windows, packed sequences or tp > 1 (the head
    phases are defined on all heads).
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection: Any = None,
        layer_cp_comm_type: Optional[str] = None,
        dilation: Any = None,
    ) -> None:
        super().__init__(config=config)
        self.layer_number = max(1, layer_number)
        self.attention_type = attention_type
        self.attn_mask_type = _check_mask_type(attn_mask_type)
        self.attention_dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.softmax_scale = (
            1.0 / math.sqrt(config.kv_channels) if softmax_scale is None else float(softmax_scale)
        )
        self.cp_comm_type = _resolve_comm(layer_cp_comm_type or cp_comm_type, config, self.layer_number,
                                          fixed=layer_cp_comm_type is not None)
        self.cp_group = _resolve_cp_group(pg_collection)
        self.ring_group: Optional[dist.ProcessGroup] | CPGroups = self.cp_group
        if self.cp_comm_type == "a2a+p2p":
            if self.cp_size == 1:  # nothing moves; any comm is plain attention
                self.cp_comm_type = "p2p"
            else:
                self.ring_group = _resolve_hierarchical_groups(pg_collection, self.cp_group)
        if self.cp_size != config.context_parallel_size:
            raise ValueError(
                f"context_parallel_size = {config.context_parallel_size} in the TransformerConfig but the CP "
                f"process group has {self.cp_size} ranks; they must agree (RoPE positions depend on it)"
            )
        self.window_size = _window(config, self.layer_number)
        self.dilation = _dilation(dilation, config, self.layer_number, self.window_size is not None)
        for field, bad in (("softmax_type", config.softmax_type != "vanilla"),
                           ("qk_clip", getattr(config, "qk_clip", False)),
                           ("log_max_attention_logit", getattr(config, "log_max_attention_logit", False))):
            if bad:
                raise ValueError(
                    f"TransformerConfig.{field} = {getattr(config, field)!r} is not supported by RingAttention "
                    "(only causal / unmasked softmax attention, optionally windowed, is)"
                )

    @property
    def cp_size(self) -> int:
        return 1 if self.cp_group is None else self.cp_group.size()

    @property
    def cp_rank(self) -> int:
        return 0 if self.cp_group is None else self.cp_group.rank()

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        """``[sq, b, np, hn]`` x ``[sq, b, ng, hn]`` x2 -> ``[sq, b, np * hn]`` (sq = local tokens);
        THD: ``[t, np, hn]`` x ``[t, ng, hn]`` x2 -> ``[t, np * hn]``."""
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by RingAttention; allowed: None")
        if self.training and self.attention_dropout > 0:
            raise ValueError(
                f"attention_dropout = {self.attention_dropout} is not supported by RingAttention in training; "
                "set TransformerConfig.attention_dropout = 0.0"
            )
        mask_type = self.attn_mask_type if attn_mask_type is None else _check_mask_type(attn_mask_type)
        causal = mask_type in _CAUSAL
        if packed_seq_params is not None:
            return self._forward_thd(query, key, value, attention_mask, packed_seq_params, causal)
        if query.dim() != 4:
            raise ValueError(f"query must be [sq, b, np, hn], got shape {tuple(query.shape)}")
        if attention_mask is not None:
            self._check_attention_mask(attention_mask, query.shape[0], causal)
        out = ring_attention(
            query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1), self.ring_group,
            causal=causal, softmax_scale=self.softmax_scale, sharding="zigzag", comm=self.cp_comm_type,
            window_size=self.ring_window(causal), dilation=self.dilation,
        )
        sq, b, heads, dim = query.shape
        return out.transpose(0, 1).reshape(sq, b, heads * dim)

    def ring_window(self, causal: bool) -> tuple[int, int]:
        """This layer's ``window_size`` for the core: unbounded without a window; a causal window
        looks back only."""
        if self.window_size is None:
            return (-1, -1)
        return (self.window_size[0], 0) if causal else self.window_size

    def _forward_thd(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Optional[torch.Tensor], params: Any, causal: bool) -> torch.Tensor:
        """Packed documents (Note [THD layout under CP] in packed.py): ``[t, np, hn]`` -> ``[t, np * hn]``."""
        if self.dilation is not None:
            raise ValueError(f"dilation = {self.dilation} does not combine with packed sequences (packed_seq_params); "
                             "allowed there: dilation None")
        layout = thd_layout(params, query.shape[0], self.cp_rank, self.cp_size, self.cp_group)
        if query.dim() != 3:
            raise ValueError(f"with packed_seq_params query must be [t, np, hn], got shape {tuple(query.shape)}")
        if attention_mask is not None:
            raise ValueError("attention_mask must be None with packed_seq_params (documents are separated by "
                             f"cu_seqlens), got a {tuple(attention_mask.shape)} tensor")
        real = None if layout.real is None else layout.real.to(query.device)
        out = ring_attention(
            query, key, value, self.cp_group, causal=causal, softmax_scale=self.softmax_scale, sharding="zigzag",
            comm=self.cp_comm_type, window_size=self.ring_window(causal), cu_seqlens=layout.cu_seqlens,
            key_padding_mask=None if causal else real,
        )
        if real is not None:
            out = out * real[:, None, None].to(out.dtype)
        return out.reshape(query.shape[0], -1)

    def _check_attention_mask(self, mask: torch.Tensor, sq_local: int, causal: bool) -> None:
        """Accept a mask only if it is the one implied by the mask type (True = masked out).

        Megatron-LM's data pipeline passes the standard causal mask ``[b|1, 1, sq, sk]`` (sq
        sharded by ``get_batch_on_this_cp_rank``, sk global). Any other mask would change the
        result, so it is rejected rather than ignored.
        """
        seq = sq_local * self.cp_size
        if mask.dtype != torch.bool or mask.dim() != 4 or tuple(mask.shape[-2:]) != (sq_local, seq):
            raise ValueError(
                f"attention_mask must be a bool [b, 1, {sq_local}, {seq}] tensor (or None), got "
                f"{mask.dtype} {tuple(mask.shape)}"
            )
        if causal:
            q_pos = local_positions(seq, self.cp_rank, self.cp_size, "zigzag", mask.device) if self.cp_size > 1 \
                else torch.arange(seq, device=mask.device)
            expected = q_pos[:, None] < torch.arange(seq, device=mask.device)[None, :]
            ok = bool((mask == expected).all())
        else:
            ok = not bool(mask.any())
        if not ok:
            kind = "the causal mask" if causal else "all-False (no masking)"
            raise ValueError(
                f"attention_mask is not {kind}; RingAttention supports only attn_mask_type in "
                f"{_mask_names(_SUPPORTED_MASKS)} without arbitrary masks (pass attention_mask=None)"
            )


def _window(config: TransformerConfig, layer_number: int) -> Optional[tuple[int, int]]:
    """``config.window_size`` if this layer is windowed (``window_attn_skip_freq``), else None; checked."""
    window = config.window_size
    if window is None:
        return None
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or any(isinstance(w, bool) or not isinstance(w, int) or w < -1 for w in window)):
        raise ValueError(f"TransformerConfig.window_size = {window!r} must be None or two ints >= -1 "
                         "(left, right; -1 = unbounded)")
    if not is_layer_window_attention(tuple(window), config.window_attn_skip_freq, layer_number):
        return None
    return int(window[0]), int(window[1])


def _dilation(dilation: Any, config: TransformerConfig, layer_number: int, windowed: bool) -> Optional[Pairs]:
    """This layer's checked dilation pairs (``dilation``: pairs, or ``{layer_number: pairs}``), or None."""
    pairs = dilation.get(layer_number) if isinstance(dilation, dict) else dilation
    if pairs is not None and config.tensor_model_parallel_size > 1:
        raise ValueError(f"dilation = {pairs!r} needs tensor_model_parallel_size = 1 (the head phases span all "
                         f"heads), got {config.tensor_model_parallel_size}")
    return check_dilation(pairs, config.num_attention_heads, {"window_size": windowed})


def _check_mask_type(mask_type: AttnMaskType) -> AttnMaskType:
    if mask_type not in _SUPPORTED_MASKS:
        name = getattr(mask_type, "name", mask_type)
        raise ValueError(
            f"attn_mask_type = {name} is not supported by RingAttention; allowed: {_mask_names(_SUPPORTED_MASKS)}"
        )
    return mask_type


def _resolve_comm(cp_comm_type: Any, config: TransformerConfig, layer_number: int, *, fixed: bool = False) -> str:
    """This layer's comm: ``layer_cp_comm_type`` (``fixed``, from a per-layer spec), else a per-layer
    ``config.cp_comm_type`` list's entry ``[layer_number - 1]`` (it wins over ``cp_comm_type``, which
    megatron-core's TransformerLayer takes from the list one layer off: Note [Per-layer
    cp_comm_type] in model.py), else ``cp_comm_type``, else the config's single name."""
    listed = isinstance(config.cp_comm_type, (list, tuple)) and not fixed
    comm = config.cp_comm_type if cp_comm_type is None or listed else cp_comm_type
    if isinstance(comm, (list, tuple)):
        comm = comm[layer_number - 1]
    comm = "p2p" if comm is None else comm
    if comm not in CP_COMM_TYPES:
        raise ValueError(f"cp_comm_type = {comm!r} is not supported by RingAttention; allowed: {list(CP_COMM_TYPES)}")
    return comm


def _resolve_hierarchical_groups(pg_collection: Any, cp_group: Optional[dist.ProcessGroup]) -> CPGroups:
    """``CPGroups(a2a, ring, cp)`` from ``pg_collection.hcp`` or Megatron's parallel_state."""
    groups = getattr(pg_collection, "hcp", None) if pg_collection is not None else None
    if not groups and parallel_state.model_parallel_is_initialized():
        groups = parallel_state.get_hierarchical_context_parallel_groups(check_initialized=False)
    if not groups or len(groups) != 2:
        raise ValueError(
            "cp_comm_type = 'a2a+p2p' needs two hierarchical CP groups [a2a, ring]: initialize_model_parallel("
            f"hierarchical_context_parallel_sizes=[a2a, cp // a2a]) or pg_collection.hcp; got {groups!r}"
        )
    return CPGroups(groups[0], groups[1], cp_group)


def _resolve_cp_group(pg_collection: Any) -> Optional[dist.ProcessGroup]:
    """The CP group: ``pg_collection.cp``, else Megatron's parallel_state, else None (single process)."""
    group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
    if group is None and parallel_state.model_parallel_is_initialized():
        group = parallel_state.get_context_parallel_group(check_initialized=False)
    if group is None and dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            "RingAttention needs a context-parallel group: pass pg_collection with .cp or call "
            "megatron.core.parallel_state.initialize_model_parallel first"
        )
    return group
