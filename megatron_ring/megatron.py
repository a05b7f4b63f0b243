"""Megatron-core integration (needs megatron-core): ``from megatron_ring.megatron import get_gpt_layer_ring_spec``.

Re-exports :mod:`megatron_ring.integrations.megatron` and the config-driven model builder; see
``docs/megatron.md``.
"""
from megatron_ring.integrations.megatron import (
    CP_COMM_TYPES,
    RingAttention,
    gather_logits,
    gather_sequence,
    get_batch_on_this_cp_rank,
    get_gpt_layer_ring_spec,
    gpt_layer_ring_spec,
    parallel_from_megatron,
    use_ring_attention,
)
from megatron_ring.integrations.megatron_model import build_gpt_model, load_full_state_dict, transformer_config

__all__ = [
    "CP_COMM_TYPES",
    "RingAttention",
    "build_gpt_model",
    "gather_logits",
    "gather_sequence",
    "get_batch_on_this_cp_rank",
    "get_gpt_layer_ring_spec",
    "gpt_layer_ring_spec",
    "load_full_state_dict",
    "parallel_from_megatron",
    "transformer_config",
    "use_ring_attention",
]
