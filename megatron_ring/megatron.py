"""Megatron-core integration (needs megatron-core): ``from megatron_ring.megatron import get_gpt_layer_ring_spec``.

The public names of :mod:`megatron_ring.integrations.megatron`; see ``docs/megatron.md``.
``torchrun --nproc_per_node N -m megatron_ring.megatron CONFIG.yaml`` checks a config against cp = 1.
"""
import sys

from megatron_ring.integrations.megatron.attention import CP_COMM_TYPES, RingAttention
from megatron_ring.integrations.megatron.batches import gather_logits, gather_sequence, get_batch_on_this_cp_rank
from megatron_ring.integrations.megatron.equivalence import check_config_main
from megatron_ring.integrations.megatron.model import build_gpt_model, load_full_state_dict, transformer_config
from megatron_ring.integrations.megatron.packed import get_thd_batch_on_this_cp_rank, pack_documents
from megatron_ring.integrations.megatron.specs import get_gpt_layer_ring_spec, gpt_layer_ring_spec, use_ring_attention
from megatron_ring.integrations.megatron.state import init_megatron, parallel_from_megatron

__all__ = [
    "CP_COMM_TYPES",
    "RingAttention",
    "build_gpt_model",
    "gather_logits",
    "gather_sequence",
    "get_batch_on_this_cp_rank",
    "get_gpt_layer_ring_spec",
    "get_thd_batch_on_this_cp_rank",
    "gpt_layer_ring_spec",
    "init_megatron",
    "load_full_state_dict",
    "pack_documents",
    "parallel_from_megatron",
    "transformer_config",
    "use_ring_attention",
]

if __name__ == "__main__":
    sys.exit(check_config_main())
