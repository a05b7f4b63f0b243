"""A Megatron-engine checkpoint, saved at any tp / pp / cp / dp layout, as a transformers checkpoint.

::

    out = export_megatron_checkpoint(Path("runs/ft/ckpt"), None, Path("runs/ft/hf"))   # latest complete tag
    model = AutoModelForCausalLM.from_pretrained(out)

The engine writes with Megatron's ``dist_checkpointing`` (``torch_dist``: PyTorch's distributed
checkpoint format), where every tensor is stored under its *global* key with its global shape, each
rank having written its pieces (Note [Global tensors of a Megatron checkpoint]). So the export needs no
process group and no Megatron model: it reads the model's tensors whole in this one process
(``no_dist``), turns them into the transformers state dict with the inverse of the converter's mapping
(:func:`~megatron_ring.integrations.megatron.hf_weights.hf_tensors`), and writes ``config.json`` (the
pretrained checkpoint's config with the trained model's fields, or a Llama / Qwen2 / Mistral config of
a model of random weights: :func:`~megatron_ring.integrations.megatron.hf_config.transformers_fields`),
the weights as safetensors (``save_pretrained``) and the tokenizer the engine stored with the checkpoint
(a pretrained model's; a model of random weights has none). The weights keep the training dtype (bf16
models export their bf16 weights, the ones the model computed with).

Note [Global tensors of a Megatron checkpoint]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Megatron's sharded state dict names a parameter by its place in the unsharded model: the layers of
every pipeline stage (and virtual stage) are one tensor ``decoder.layers.<name>`` with a leading layer
axis ``[num_layers, ...]``, each stage writing its layers' rows; a TP-split parameter is stored whole,
each TP rank writing its slice; a gated fc1 ``[gate; up]`` is written as two halves, each split over
TP, so the stored tensor is the unsharded ``[gate; up]`` again; tied output weights are stored once,
as the embedding; the layers' norms are stored under Transformer Engine's names (the layer spec's
``sharded_state_dict_keys_map``). The global tensors are therefore exactly the tp = pp = 1 parameters the converter
makes (``HFWeights``), whatever layout saved them; cp and dp ranks hold replicas.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Optional

import torch

from megatron_ring.training.checkpoint import COMPLETE, latest_checkpoint
from megatron_ring.training.megatron_engine import TOKENIZER_DIR, TRAIN_STATE
from megatron_ring.training.pretrained import MODEL_FILE

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def export_megatron_checkpoint(checkpoint_dir: Path, tag: Optional[str], out_dir: Path) -> Path:
    """Write the transformers checkpoint of ``checkpoint_dir/tag`` (None: the latest complete one) into
    ``out_dir``; returns ``out_dir``.

    ValueError naming the path when ``checkpoint_dir`` holds no complete Megatron-engine checkpoint (or
    ``tag`` is not one), and naming the field when the model cannot be a transformers Llama / Qwen2 /
    Mistral (LayerNorm, GELU, ...).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_ring.config.gpt import GPTConfig
    from megatron_ring.integrations.megatron.hf_config import model_fields, transformers_fields
    from megatron_ring.integrations.megatron.hf_weights import hf_tensors, megatron_names

    folder = checkpoint_folder(Path(checkpoint_dir), tag)
    description = json.loads((folder / MODEL_FILE).read_text())
    gpt = GPTConfig.parse(description["gpt"], where=str(folder / MODEL_FILE))
    fields = {**gpt.model.model_dump(mode="json"), "head_dim": gpt.model.kv_channels,
              "num_query_groups": gpt.model.query_groups}
    hf = transformers_fields(fields, description["hf_config"])
    again = model_fields(hf)  # the config must convert back to the trained model
    differ = {k: (again.get(k), fields.get(k)) for k in {*again, "window_size", "rope_scaling"}
              if k != "seq_length" and fields.get(k) != again.get(k)}
    if differ:
        raise ValueError(f"{str(folder)!r}: the written transformers config would load another model; "
                         f"(config, trained) of the fields that differ: {differ}")
    full = read_global_tensors(folder, needed=megatron_names(fields))
    tensors = hf_tensors(fields, full)
    dtype = next(iter(tensors.values())).dtype
    kind = hf.pop("model_type")
    config = AutoConfig.for_model(kind, **{k: v for k, v in hf.items() if k not in ("dtype", "torch_dtype")})
    config.dtype = dtype
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"{str(folder)!r}: transformers' {kind} model lacks {unexpected} or misses "
                         f"{sorted(set(missing) - tied)}")
    model.tie_weights()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    if (folder / TOKENIZER_DIR).is_dir():
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(folder / TOKENIZER_DIR, local_files_only=True).save_pretrained(out_dir)
    return out_dir


def checkpoint_folder(checkpoint_dir: Path, tag: Optional[str]) -> Path:
    """``checkpoint_dir/tag`` (None: the latest tag with a complete marker), or ValueError naming what is
    missing when it is not a complete Megatron-engine checkpoint."""
    if not checkpoint_dir.is_dir():
        raise ValueError(f"checkpoint directory {str(checkpoint_dir)!r} does not exist")
    if tag is None:
        tag = latest_checkpoint(checkpoint_dir)
        if tag is None:
            raise ValueError(f"{str(checkpoint_dir)!r} holds no complete checkpoint (no step*/{COMPLETE}); give the "
                             "checkpoint.dir of a training run")
    folder = checkpoint_dir / tag
    if not (folder / COMPLETE).is_file():
        present = sorted(p.name for p in checkpoint_dir.iterdir() if (p / COMPLETE).is_file())
        raise ValueError(f"tag = {tag!r}: {str(folder)!r} is not a complete checkpoint; complete ones: {present}")
    for name, what in ((TRAIN_STATE, "an engine 'megatron' checkpoint"), (MODEL_FILE, "its model description "
                                                                           "(written by this version's engine)")):
        if not (folder / name).is_file():
            raise ValueError(f"{str(folder)!r} has no {name}: not {what}; a DeepSpeed-engine checkpoint is "
                             "exported by its own path")
    return folder


def read_global_tensors(folder: Path, needed: list[str]) -> dict[str, torch.Tensor]:
    """Megatron's global name (``decoder.layers.3.mlp.linear_fc1.weight``) -> its whole tensor, read from
    the ``torch_dist`` checkpoint in ``folder`` in this process alone (Note [Global tensors of a Megatron
    checkpoint]); ValueError naming a tensor the checkpoint lacks."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(folder))
    stored = reader.read_metadata().state_dict_metadata
    renames = _layer_key_renames()
    keys = sorted({_stored_key(name, renames) for name in needed})
    missing = [key for key in keys if key not in stored]
    if missing:
        raise ValueError(f"{str(folder)!r} lacks the model tensors {missing}")
    state = {key: torch.empty(tuple(stored[key].size), dtype=stored[key].properties.dtype) for key in keys}
    dcp.load(state, storage_reader=reader, no_dist=True)
    out = {}
    for name in needed:
        layer = _LAYER.match(name)
        out[name] = state[_stored_key(name, renames)][int(layer.group(1))] if layer else state[name]
    return out


def _stored_key(name: str, renames: dict[str, str]) -> str:
    """The key a global parameter name is stored under: layers share one stacked tensor, and some
    layer parameters are stored under the name of their fused Transformer-Engine counterpart."""
    layer = _LAYER.match(name)
    if not layer:
        return name
    inner = layer.group(2)
    for old, new in renames.items():
        if inner.startswith(old):
            inner = new + inner[len(old):]
    return f"decoder.layers.{inner}"


def _layer_key_renames() -> dict[str, str]:
    """The layer spec's ``sharded_state_dict_keys_map``: Megatron stores the local spec's norms under the
    names of Transformer Engine's fused norm + linear (``input_layernorm.`` as
    ``self_attention.linear_qkv.layer_norm_``), so that checkpoints of both specs are interchangeable."""
    from megatron_ring.integrations.megatron.specs import get_gpt_layer_ring_spec

    return dict(get_gpt_layer_ring_spec(normalization="RMSNorm").submodules.sharded_state_dict_keys_map)
