"""Hugging Face transformers with ring attention: the public names of :mod:`megatron_ring.integrations.hf`
(and :func:`init_autotp` from :mod:`megatron_ring.integrations.deepspeed.autotp` for TP x CP with DeepSpeed).

Importing it registers ``attn_implementation="ring"`` with transformers (needs ``transformers``).
See docs/transformers.md.
"""
from megatron_ring.integrations.deepspeed.autotp import init_autotp
from megatron_ring.integrations.hf.attention import enable_ring_attention, register
from megatron_ring.integrations.hf.cache import RingCache
from megatron_ring.integrations.hf.context import ATTN_IMPLEMENTATION, CPContext, cp_context
from megatron_ring.integrations.hf.generate import ring_forward, ring_generate
from megatron_ring.integrations.hf.nll import TokenScores, ring_nll, ring_token_scores
from megatron_ring.integrations.hf.turns import (
    ring_decode_rows, ring_decode_step, ring_extend, ring_prefill_documents,
)

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CPContext",
    "RingCache",
    "TokenScores",
    "cp_context",
    "enable_ring_attention",
    "init_autotp",
    "register",
    "ring_decode_rows",
    "ring_decode_step",
    "ring_extend",
    "ring_forward",
    "ring_generate",
    "ring_nll",
    "ring_prefill_documents",
    "ring_token_scores",
]
