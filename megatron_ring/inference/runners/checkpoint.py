"""A transformers checkpoint behind a runner (hf, megatron): where it is, its config, its weights.

Both runners name a checkpoint with the same keys (:class:`~megatron_ring.config.checkpoint.CheckpointSource`):
a directory, a ``.gguf`` file, or ``package:<module>``. :func:`locate` finds it or raises a
ConfigError naming the key; :func:`read_config` reads its config without the weights (validation);
:func:`gpt_config` turns a ``configs/megatron`` mapping, sizes or checkpoint, into its
:class:`~megatron_ring.config.gpt.GPTConfig` (the megatron runner, the planner); :func:`load_checkpoint`
loads model and tokenizer on every rank (the hf runner; :func:`load_for_autotp` at tp > 1: an empty model that
AutoTP cuts before each rank reads its slices), :func:`load_weights` the weights as Megatron's
names, read a slice at a time by each rank (the megatron runner, Note [Sharded loading] in
``integrations/megatron/hf_checkpoint.py``), a GGUF file converted once by rank 0 first (Note [GGUF
conversion cache] in ``integrations/hf/checkpoint.py``). Nothing here imports megatron-core.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch

from megatron_ring.config import ConfigError
from megatron_ring.config.checkpoint import CheckpointSource
from megatron_ring.config.gpt import GPTConfig, parse_model_file
from megatron_ring.integrations.deepspeed.autotp_slices import checkpoint_names
from megatron_ring.integrations.hf.checkpoint import empty_causal_lm, gguf_location, load_causal_lm, load_config, \
    load_tokenizer, local_dir_once, resolve_checkpoint
from megatron_ring.integrations.megatron.hf_checkpoint import checkpoint_weights
from megatron_ring.integrations.megatron.hf_config import model_fields
from megatron_ring.integrations.megatron.hf_weights import HFWeights
from megatron_ring.integrations.megatron.tensor_source import SafetensorsTensors


def locate(source: CheckpointSource, where: str) -> tuple[Path, Optional[tuple[Path, str]]]:
    """The checkpoint path and its GGUF location (None for a directory), or a ConfigError naming the key."""
    try:
        path = resolve_checkpoint(source.checkpoint)
        return path, gguf_location(path, source.gguf_file)
    except ValueError as err:
        raise ConfigError(str(err), where=where) from None


def _cache_dir(source: CheckpointSource) -> Optional[Path]:
    return Path(source.cache_dir) if source.cache_dir else None


def read_config(source: CheckpointSource, where: str) -> dict[str, Any]:
    """The checkpoint's transformers config as a mapping (``PretrainedConfig.to_dict()``), weights unread;
    ConfigError naming ``checkpoint`` when it cannot be read."""
    path, _ = locate(source, where)
    try:
        return load_config(path, source.gguf_file, _cache_dir(source)).to_dict()
    except (OSError, ValueError) as err:
        raise ConfigError(f"checkpoint = {source.checkpoint!r}: its config cannot be read ({err})", where=where) from None


def gpt_config(model: Any, *, where: str) -> GPTConfig:
    """The :class:`GPTConfig` of a ``configs/megatron`` mapping: its ``model`` section, or a checkpoint's
    sizes read from its config (weights unread); what cannot be converted is a ConfigError naming the
    checkpoint and the field."""
    file = parse_model_file(model, where=where)
    if isinstance(file, GPTConfig):
        return file
    hf_config = read_config(file, where)
    try:
        fields = model_fields(hf_config)
    except ValueError as err:
        raise ConfigError(f"checkpoint = {file.checkpoint!r}: {err}", where=where) from None
    return file.with_model(fields, where=where)


def load_checkpoint(source: CheckpointSource, *, dtype: torch.dtype, attn_implementation: str,
                    where: str) -> tuple[Any, Any]:
    """``(model, tokenizer)`` on every rank (eval mode, on CPU); a GGUF file is converted by rank 0 while the
    others wait, so a job converts it once."""
    path, _ = locate(source, where)
    local_dir_once(path, source.gguf_file, _cache_dir(source))
    return load_causal_lm(path, gguf_file=source.gguf_file, dtype=dtype, attn_implementation=attn_implementation,
                          cache_dir=_cache_dir(source))


def load_for_autotp(source: CheckpointSource, *, tp: int, dtype: torch.dtype, attn_implementation: str,
                    where: str) -> tuple[Any, Any, Optional[tuple[Any, dict[str, str]]]]:
    """``(model, tokenizer, slices)`` on every rank for AutoTP over ``tp`` ranks. At tp > 1, when the checkpoint's
    weights are safetensors files holding every parameter under its name: the model with its parameters on the meta
    device and ``slices`` = (the files, parameter -> tensor name) for
    :func:`~megatron_ring.integrations.deepspeed.autotp_slices.fill_autotp_slices` after AutoTP (Note [AutoTP
    from slices]); otherwise the whole model loaded (:func:`load_checkpoint`) and ``slices`` None."""
    path, _ = locate(source, where)
    if tp > 1:
        directory = local_dir_once(path, source.gguf_file, _cache_dir(source))
        files = SafetensorsTensors.of(directory)
        if files is not None:
            model = empty_causal_lm(directory, dtype=dtype, attn_implementation=attn_implementation)
            names = checkpoint_names(model, files)
            if names is not None:
                return model, load_tokenizer(directory), (files, names)
    model, tokenizer = load_checkpoint(source, dtype=dtype, attn_implementation=attn_implementation, where=where)
    return model, tokenizer, None


def load_weights(source: CheckpointSource, *, where: str) -> tuple[HFWeights, Any]:
    """``(HFWeights, tokenizer)`` on every rank: the weights by Megatron's unsharded names, nothing read until a
    rank loads its stage and TP slices from them (Note [Sharded loading]); a GGUF file is converted by rank 0
    while the others wait. ConfigError naming the checkpoint when its tensors do not fit the converter."""
    path, _ = locate(source, where)
    directory = local_dir_once(path, source.gguf_file, _cache_dir(source))
    try:
        weights = checkpoint_weights(directory)
    except ValueError as err:
        raise ConfigError(f"checkpoint = {source.checkpoint!r}: {err}", where=where) from None
    return weights, load_tokenizer(directory)


def source_tokenizer(source: CheckpointSource, where: str) -> Any:
    """The checkpoint's tokenizer in this one process (before any rank: a GGUF file is converted here, once)."""
    path, _ = locate(source, where)
    try:
        return load_tokenizer(path, gguf_file=source.gguf_file, cache_dir=_cache_dir(source))
    except (OSError, ValueError) as err:
        raise ConfigError(f"checkpoint = {source.checkpoint!r}: its tokenizer cannot be read ({err})",
                          where=where) from None
