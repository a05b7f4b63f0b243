"""A transformers model sharded by AutoTP before it has weights, then given each rank's slices from the files.

::

    model = empty_causal_lm(directory, dtype=torch.float32, attn_implementation="ring")  # parameters on meta
    names = checkpoint_names(model, files)     # parameter -> checkpoint tensor; None: the files do not fit
    model = init_autotp(model, tp_group, ds_config)                                      # shapes only
    fill_autotp_slices(model, files, names)    # buffers computed, each parameter read: its slice only

Note [AutoTP from slices]
~~~~~~~~~~~~~~~~~~~~~~~~~
AutoTP cuts a model's linear layers as it replaces them (``LinearLayer``: rows, ``LinearAllreduce`` and
``LmHeadLinearAllreduce``: columns), and it takes a model on the meta device: each replacement then
holds an empty tensor of this rank's shape, and the layer records how the whole was cut,
``_partition_sizes`` (every rank's extent, uneven for SmolLM2's 9 query / 3 K/V heads at tp 2) and
``tp_index``. A parameter smaller than its checkpoint tensor in one dimension is therefore the
contiguous slice of that dimension starting at the sum of the lower ranks' extents; one of the
checkpoint's shape is whole (embeddings, norms, a row-parallel bias, an output head whose columns
all fell to this rank). Reading exactly that slice into the parameter gives the tensor AutoTP would
have cut from the whole model, bit for bit (the same values, cast by the same ``copy_``), without
the whole model ever in memory. Buffers (RoPE's ``inv_freq``) are not in the checkpoint; transformers'
own ``_init_weights`` computes them, as its ``from_pretrained`` does.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol

import torch


class SliceSource(Protocol):
    """Checkpoint tensors read a slice at a time (``integrations/megatron/tensor_source.py``'s sources)."""

    def keys(self) -> Any:
        """Every tensor name."""

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, unread."""

    def read(self, name: str, dim: int = 0, start: int = 0, stop: Optional[int] = None,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Rows ``start:stop`` along ``dim`` copied into ``out``."""


def checkpoint_names(model: torch.nn.Module, files: SliceSource) -> Optional[dict[str, str]]:
    """Each parameter name of ``model`` (before AutoTP; tied ones under every name) -> the checkpoint tensor of
    its shape it is read from (a tied output head: the embedding the file keeps); None when one has none."""
    names = set(files.keys())
    by_tensor: dict[int, list[str]] = {}
    params = list(model.named_parameters(remove_duplicate=False))
    for name, param in params:
        by_tensor.setdefault(id(param), []).append(name)
    out: dict[str, str] = {}
    for name, param in params:
        stored = [n for n in by_tensor[id(param)] if n in names]
        if not stored or files.shape(stored[0]) != tuple(param.shape):
            return None
        out[name] = name if name in names else stored[0]
    return out


@torch.no_grad()
def fill_autotp_slices(model: Any, files: SliceSource, names: dict[str, str]) -> None:
    """Give ``model`` (a transformers model after :func:`~megatron_ring.integrations.deepspeed.autotp.init_autotp`
    on the meta device) its buffers and each parameter its AutoTP slice read from ``files`` (Note [AutoTP from
    slices]); ``names``: :func:`checkpoint_names` before AutoTP. ValueError naming a parameter whose slice cannot
    be told from its layer."""
    for module in model.modules():
        for key, param in list(module._parameters.items()):
            if param is not None and param.is_meta:  # a layer AutoTP left alone: allocate it here
                module._parameters[key] = torch.nn.Parameter(torch.empty_like(param, device="cpu"),
                                                             requires_grad=param.requires_grad)
        if next(module.buffers(recurse=False), None) is not None:
            model._init_weights(module)
    for prefix, module in model.named_modules():
        for key, param in module.named_parameters(recurse=False):
            name = f"{prefix}.{key}" if prefix else key
            if name not in names:
                raise ValueError(f"parameter {name!r} after AutoTP has no checkpoint tensor")
            source = names[name]
            full = files.shape(source)
            cut = [d for d in range(param.dim()) if param.shape[d] != full[d]]
            if not cut:
                files.read(source, out=param)
                continue
            sizes = getattr(module, "_partition_sizes", None)
            index = getattr(module, "tp_index", None)
            if len(cut) != 1 or sizes is None or index is None or sizes[index] != param.shape[cut[0]]:
                raise ValueError(f"parameter {name!r} has shape {tuple(param.shape)} against {source!r} {full}: "
                                 "not a slice AutoTP recorded")
            start = sum(sizes[:index])
            files.read(source, cut[0], start, start + sizes[index], out=param)
