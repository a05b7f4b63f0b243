"""Hugging Face transformers with ring attention: re-export of :mod:`megatron_ring.integrations.transformers`.

Importing it registers ``attn_implementation="ring"`` with transformers (needs ``transformers``).
"""
from megatron_ring.integrations.transformers import (
    ATTN_IMPLEMENTATION,
    CPContext,
    RingCache,
    cp_context,
    enable_ring_attention,
    register,
    ring_forward,
    ring_generate,
)

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CPContext",
    "RingCache",
    "cp_context",
    "enable_ring_attention",
    "register",
    "ring_forward",
    "ring_generate",
]
