"""Megatron's sequence parallelism (``TransformerConfig.sequence_parallel``) with torch's norms.

Note [Sequence parallelism and the ring]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With ``sequence_parallel`` the activations between the TP regions (embedding output, norms,
dropout, residuals) are split along the sequence over the TP ranks: a CP rank's ``s_local = s / cp``
tokens (its two zigzag chunks, in order) become ``[s_local / tp, b, h]`` on each TP rank. Megatron
all-gathers them along the sequence in the column-parallel QKV projection and reduce-scatters
after the row-parallel output projection, so the core attention still sees this CP rank's whole
local sequence, ``[s_local, b, heads / tp, d]``: RingAttention, its zigzag positions and RoPE
(applied after the gather) are unchanged. ``s_local`` must split evenly over tp:
``seq_length % (cp * tp) == 0`` (:meth:`~megatron_ring.config.gpt.GPTConfig.check`; training pads
its rows, :func:`~megatron_ring.training.data.row_length`).

Each TP rank's norms then see other tokens, so their weight gradients are partial sums over the
sequence: Megatron marks such parameters ``sequence_parallel`` and ``finalize_model_grads``
all-reduces them over TP. Apex's and Transformer Engine's norms carry the mark; torch's
(``WrappedTorchNorm``, megatron-core's choice without either) refuse sequence parallelism
outright. :class:`SequenceParallelNorm` is torch's norm with the mark, so sequence parallelism
runs on any device.
"""
from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlock, TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.torch_norm import WrappedTorchNorm

NORM_FIELDS = ("input_layernorm", "pre_cross_attn_layernorm", "pre_mlp_layernorm")
"""The norms of Megatron's ``TransformerLayerSubmodules``."""


class SequenceParallelNorm:
    """``torch.nn.LayerNorm`` / ``RMSNorm`` of ``hidden_size`` (``WrappedTorchNorm``'s constructor), its
    parameters marked ``sequence_parallel`` as the config says (Note [Sequence parallelism and the ring])."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.Module:
        if config.normalization == "LayerNorm":
            norm: torch.nn.Module = torch.nn.LayerNorm(hidden_size, eps=eps)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        else:
            raise ValueError(f"normalization = {config.normalization!r} with sequence_parallel; allowed: "
                             "'LayerNorm', 'RMSNorm'")
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
        return norm


def sequence_parallel_block(layer: ModuleSpec, num_layers: int) -> ModuleSpec:
    """A ``TransformerBlock`` spec of ``num_layers`` copies of ``layer`` whose torch norms (``WrappedTorchNorm``,
    the final norm included) are :class:`SequenceParallelNorm`."""
    layer = copy.deepcopy(layer)
    for field in NORM_FIELDS:
        if getattr(layer.submodules, field, None) is WrappedTorchNorm:
            setattr(layer.submodules, field, SequenceParallelNorm)
    final = SequenceParallelNorm if LayerNormImpl is WrappedTorchNorm else LayerNormImpl
    return ModuleSpec(module=TransformerBlock, submodules=TransformerBlockSubmodules(
        layer_specs=[layer] * num_layers, layer_norm=final))


SWITCHES = ("sequence_parallel", "reduce_scatter_embeddings")
"""Attributes of Megatron's modules that fix sequence parallelism at construction (tensor-parallel linears,
the embedding and its vocabulary-parallel table)."""


@contextmanager
def sequence_parallel_off(model: torch.nn.Module) -> Iterator[None]:
    """Inside the block ``model`` (a GPTModel) runs without sequence parallelism: its config's flag and
    every module's :data:`SWITCHES` set False, restored after. For a call whose sequence cannot split
    over the TP ranks (a decode step's one token); the weights are the same either way."""
    config = model.config
    saved = [(module, name, getattr(module, name)) for module in model.modules() for name in SWITCHES
             if isinstance(getattr(module, name, None), bool)]
    was = config.sequence_parallel
    try:
        config.sequence_parallel = False
        for module, name, _ in saved:
            setattr(module, name, False)
        yield
    finally:
        config.sequence_parallel = was
        for module, name, value in saved:
            setattr(module, name, value)
