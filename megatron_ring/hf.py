"""Hugging Face transformers with ring attention: re-export of :mod:`megatron_ring.integrations.transformers`
(and :func:`init_autotp` from :mod:`megatron_ring.integrations.hf_autotp` for TP x CP with DeepSpeed).

Importing it registers ``attn_implementation="ring"`` with transformers (needs ``transformers``).
See docs/transformers.md.
"""
from megatron_ring.integrations.hf_autotp import init_autotp
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
    "init_autotp",
    "register",
    "ring_forward",
    "ring_generate",
]
