"""Hugging Face transformers with ring attention: re-export of :mod:`megatron_ring.integrations.transformers`
(and :func:`init_autotp` from :mod:`megatron_ring.integrations.hf_autotp` for TP x CP with DeepSpeed).

Importing it registers ``attn_implementation="ring"`` with transformers (needs ``transformers``).
See docs/transformers.md.
"""
from megatron_ring.integrations import transformers as _transformers
from megatron_ring.integrations.hf_autotp import init_autotp
from megatron_ring.integrations.transformers import *  # noqa: F401,F403 -- exactly its __all__

__all__ = [*_transformers.__all__, "init_autotp"]
