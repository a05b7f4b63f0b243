"""megatron_ring: exact ring attention with context (sequence) parallelism for PyTorch.

The public surface is small::

    from megatron_ring import ring_attention, decode_attention, shard_sequence, unshard_sequence
    from megatron_ring import ParallelLayout, init_parallel

Integrations (``megatron_ring.megatron``, ``megatron_ring.hf``, DeepSpeed launch) are imported
only on demand, so ``import megatron_ring`` needs torch alone.
"""
from megatron_ring.attention.decode import decode_attention
from megatron_ring.attention.api import ring_attention
from megatron_ring.attention.sharding import shard_sequence, unshard_sequence
from megatron_ring.parallel.groups import init_parallel
from megatron_ring.parallel.layout import ParallelLayout

__version__ = "0.1.0"
__all__ = [
    "ParallelLayout",
    "decode_attention",
    "init_parallel",
    "ring_attention",
    "shard_sequence",
    "unshard_sequence",
]
