"""Build a real ``megatron.core`` GPTModel from a validated :class:`~megatron_ring.config.gpt.GPTConfig`.

``attention: local`` uses Megatron's own local spec (``DotProductAttention``, unfused: it materialises
the ``L x L`` scores); ``attention: ring`` and ``attention: sdpa`` (cp = 1: the same fused block kernel
without a ring, the fair baseline) the same spec with :class:`~megatron_ring.integrations.megatron.attention.RingAttention`; nothing else
differs. Megatron's ``parallel_state`` must already be initialised with the config's tp/pp/cp.

:func:`load_full_state_dict` loads one unsharded (tp = pp = 1) state dict into a model of any
tp/pp layout, so differently parallelised models can be given identical weights.

Note [Per-layer cp_comm_type]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Megatron lets ``TransformerConfig.cp_comm_type`` be a list, one comm per layer, and RingAttention
reads its layer's entry from such a list (``[layer_number - 1]``). megatron-core's
``TransformerLayer`` (the installed version) indexes the list with the 1-based ``layer_number``
itself, which is one layer off and fails on the last layer before any attention is built. So
this builder keeps the list out of the TransformerConfig and gives each layer's RingAttention its
comm through a per-layer spec instead (``ModuleSpec(params={"layer_cp_comm_type": ...})``; Megatron's attention passes its own
``cp_comm_type`` argument, None here).

Note [Gated fc1 shards]
~~~~~~~~~~~~~~~~~~~~~~~
With ``activation: swiglu`` (``gated_linear_unit``) the unsharded fc1 weight is ``[gate; up]``
(``2 * ffn`` rows) and Megatron's MLP splits its *local* output in two halves, gate then up. A TP
rank must therefore hold ``[gate rows of rank r; up rows of rank r]``, not the r-th contiguous
block of the whole matrix (which would give rank 0 all of gate, rank 1 all of up): each half is
split over the TP ranks and the two pieces are concatenated (:func:`shard_of` with ``gated``).

Note [Initial weights of any layout]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Megatron's CPU initialisation draws a TP-split weight whole and slices it, so tp does not change
the initial model; pp does: a later stage starts drawing from the seed where the first stage's
embedding drew, so its layers get other values than at pp = 1. To compare layouts (and to resume
one run at another layout and compare with the run that never stopped) every layout must start
from the same model. :func:`initialize_by_name` therefore draws each parameter whole from a
generator seeded by the seed and the parameter's *global* name (layer index across stages),
with Megatron's default distributions, and keeps this rank's TP slice.
"""
from __future__ import annotations

import copy
import math
import re
import zlib
from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (LayerNormImpl, TransformerBlockSubmodules,
                                                         get_num_layers_to_build)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from megatron_ring.config.gpt import GPTConfig
from megatron_ring.integrations.megatron.hf_weights import HFWeights
from megatron_ring.integrations.megatron.sequence_parallel import sequence_parallel_block
from megatron_ring.integrations.megatron.specs import get_gpt_layer_ring_spec
from megatron_ring.integrations.megatron.state import check_parallel_state

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def transformer_config(cfg: GPTConfig, **overrides: Any) -> TransformerConfig:
    """The Megatron ``TransformerConfig`` of ``cfg`` (CPU initialisation when CUDA is absent);
    ``overrides`` are further ``TransformerConfig`` fields (the training engine's recompute options)."""
    m, p = cfg.model, cfg.parallel
    dtype = DTYPES[cfg.dtype]
    return TransformerConfig(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.query_groups,
        kv_channels=m.kv_channels,
        ffn_hidden_size=m.ffn_hidden_size,
        normalization=m.normalization,
        layernorm_epsilon=m.norm_epsilon,
        gated_linear_unit=m.activation == "swiglu",
        activation_func=F.silu if m.activation == "swiglu" else F.gelu,
        add_bias_linear=m.add_bias_linear,
        add_qkv_bias=m.add_qkv_bias,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        window_size=None if m.window_size is None else tuple(m.window_size),
        window_attn_skip_freq=m.window_attn_skip_freq,
        tensor_model_parallel_size=p.tp,
        pipeline_model_parallel_size=p.pp,
        context_parallel_size=p.cp,
        cp_comm_type=p.cp_comm_type if p.cp > 1 and not isinstance(p.cp_comm_type, list) else None,
        hierarchical_context_parallel_sizes=None if p.cp_a2a is None else [p.cp_a2a, p.cp // p.cp_a2a],
        sequence_parallel=p.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=cfg.dtype == "bf16",
        fp16=cfg.dtype == "fp16",
        use_cpu_initialization=not torch.cuda.is_available(),
        **overrides,
    )


def _keep(weight: torch.Tensor) -> None:
    """An init method that leaves ``weight`` as allocated (see :func:`weights_to_be_loaded`)."""


def weights_to_be_loaded() -> dict[str, Any]:
    """``TransformerConfig`` overrides (:func:`build_gpt_model`) for a model whose every parameter is loaded right
    after it is built: the init methods leave the weights as allocated. Megatron still allocates each weight
    and marks its TP attributes (``perform_initialization=False`` would skip the marks on CPU), but draws no
    random master weight, so building costs neither its time nor its pages (Note [Sharded loading] in
    ``hf_checkpoint.py``)."""
    return {"init_method": _keep, "output_layer_init_method": _keep, "embedding_init_method": _keep}


def layer_spec(cfg: GPTConfig, config: Optional[TransformerConfig] = None, vp_stage: Optional[int] = None
               ) -> ModuleSpec | TransformerBlockSubmodules:
    """Megatron's local GPT layer spec; ``core_attention`` is RingAttention unless ``cfg.attention == "local"``.

    A per-layer ``parallel.cp_comm_type`` list becomes one layer spec per layer of this pipeline
    stage, each RingAttention given its layer's comm (Note [Per-layer cp_comm_type]). With
    ``parallel.sequence_parallel`` the norms are :class:`SequenceParallelNorm` (``config`` and
    ``vp_stage``: the chunk's TransformerConfig and virtual stage, which fix its number of layers)."""
    kwargs = {"normalization": cfg.model.normalization}
    if cfg.attention == "local":
        spec = get_gpt_layer_local_spec(**kwargs)
    else:
        dilation = None if cfg.model.dilation is None else tuple(tuple(pair) for pair in cfg.model.dilation)
        spec = get_gpt_layer_ring_spec(dilation=dilation, **kwargs)
    comms = cfg.parallel.cp_comm_type
    if cfg.parallel.sequence_parallel:
        if config is None:
            raise ValueError("parallel.sequence_parallel: layer_spec needs the TransformerConfig (its layer count)")
        if isinstance(comms, list) and cfg.parallel.cp > 1:
            raise ValueError("parallel.sequence_parallel with a per-layer parallel.cp_comm_type list is not "
                             "supported; give one cp_comm_type")
        return sequence_parallel_block(spec, get_num_layers_to_build(config, vp_stage=vp_stage))
    if cfg.attention == "local" or not isinstance(comms, list) or cfg.parallel.cp == 1:
        return spec
    per_stage = cfg.model.num_layers // cfg.parallel.pp
    first = parallel_state.get_pipeline_model_parallel_rank() * per_stage
    layers = []
    for comm in comms[first:first + per_stage]:
        layer = copy.deepcopy(spec)
        attention = layer.submodules.self_attention.submodules
        core = attention.core_attention  # RingAttention, or its ModuleSpec with the dilation
        if not isinstance(core, ModuleSpec):
            core = ModuleSpec(module=core)
        attention.core_attention = ModuleSpec(module=core.module, params={**core.params, "layer_cp_comm_type": comm})
        layers.append(layer)
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=LayerNormImpl)  # the final norm, as Megatron's own


def build_gpt_model(cfg: GPTConfig, *, pre_process: Optional[bool] = None, post_process: Optional[bool] = None,
                    vp_stage: Optional[int] = None, **overrides: Any) -> torch.nn.Module:
    """A ``GPTModel`` for this rank's pipeline stage (wrapped in ``Float16Module`` for bf16/fp16).

    ``pre_process``/``post_process`` default to whether this rank is the first/last PP stage.
    Outputs follow GPTModel: logits ``[b, s_local, vocab / tp]`` (or per-token loss ``[b, s_local]``
    with labels) on the last stage, hidden states ``[s_local, b, h]`` elsewhere. ``vp_stage``: this
    model chunk's virtual pipeline stage (interleaved 1F1B); ``overrides``: see :func:`transformer_config`.
    """
    check_parallel_state(cfg)
    config = transformer_config(cfg, **overrides)
    first = parallel_state.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(cfg, config, vp_stage),
        vocab_size=cfg.model.vocab_size,
        max_sequence_length=cfg.model.seq_length,
        pre_process=first if pre_process is None else pre_process,
        post_process=last if post_process is None else post_process,
        vp_stage=vp_stage,
        share_embeddings_and_output_weights=cfg.model.tie_embeddings,
        position_embedding_type=cfg.model.position_embedding,
        rotary_base=cfg.model.rotary_base,
        **_rope_scaling(cfg),
    )
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    if cfg.dtype != "fp32":
        model = Float16Module(config, model)
    return model


def _rope_scaling(cfg: GPTConfig) -> dict[str, Any]:
    """GPTModel's RoPE scaling arguments for ``model.rope_scaling``: llama3 is Megatron's ``rope_scaling``,
    linear its ``seq_len_interpolation_factor`` (positions divided by the factor)."""
    scaling = cfg.model.rope_scaling
    if scaling is None:
        return {}
    if scaling.type == "llama3":
        return {"rope_scaling": True, "rope_scaling_factor": scaling.factor}
    return {"seq_len_interpolation_factor": scaling.factor}


def unwrap(model: torch.nn.Module) -> GPTModel:
    """The GPTModel inside a ``Float16Module`` (or the model itself)."""
    return model.module if isinstance(model, Float16Module) else model  # type: ignore[return-value]


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def global_name(model: torch.nn.Module, name: str) -> str:
    """Name of a local parameter in the unsharded model: local layer index -> global index."""
    inner = unwrap(model)
    offset = get_transformer_layer_offset(inner.config, vp_stage=getattr(inner, "vp_stage", None))
    return _LAYER.sub(lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name)


def is_gated_fc1(model: torch.nn.Module, key: str) -> bool:
    """Whether global parameter ``key`` is the fc1 of a gated MLP (``[gate; up]``, Note [Gated fc1 shards])."""
    return bool(unwrap(model).config.gated_linear_unit) and ".mlp.linear_fc1." in key


def shard_of(param: torch.Tensor, full: torch.Tensor, *, gated: bool = False) -> torch.Tensor:
    """This TP rank's slice of ``full`` for a Megatron parameter (contiguous split along its partition dim).

    ``gated``: ``full`` is a gated MLP's fc1, whose halves are split each (Note [Gated fc1 shards]).
    """
    if not getattr(param, "tensor_model_parallel", False):
        return full
    dim = param.partition_dim
    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    if gated:
        return torch.cat([half.chunk(tp, dim=dim)[rank] for half in full.chunk(2, dim=dim)], dim=dim)
    return full.chunk(tp, dim=dim)[rank]


def load_full_state_dict(model: torch.nn.Module, full: Mapping[str, torch.Tensor]) -> None:
    """Copy an unsharded GPTModel state dict into this rank's (TP-sharded, PP-staged) ``model``.

    Parameters are mapped by global layer index and sliced along their TP partition dim. With tied
    embeddings the last stage's ``output_layer.weight`` comes from ``embedding.word_embeddings.weight``.
    Only this stage's names are read; from an :class:`HFWeights` only this TP rank's slices
    (:meth:`HFWeights.tp_slice`: a checkpoint read from its files is read a slice at a time).
    """
    inner = unwrap(model)
    with torch.no_grad():
        for name, param in inner.named_parameters():
            key = global_name(inner, name)
            if key not in full and key == "output_layer.weight":
                key = "embedding.word_embeddings.weight"
            if key not in full:
                raise KeyError(f"parameter {name!r} (global {key!r}) is missing from the full state dict")
            gated = is_gated_fc1(inner, key)
            if isinstance(full, HFWeights):  # read into the parameter: no copy of the whole tensor
                split = getattr(param, "tensor_model_parallel", False)
                try:
                    full.tp_slice(key, dim=param.partition_dim if split else 0, gated=gated, out=param,
                                  parts=parallel_state.get_tensor_model_parallel_world_size() if split else 1,
                                  index=parallel_state.get_tensor_model_parallel_rank() if split else 0)
                except ValueError as err:
                    raise ValueError(f"{name}: {err}") from None
                continue
            src = shard_of(param, full[key], gated=gated)
            if src.shape != param.shape:
                raise ValueError(f"{name}: full-state shard has shape {tuple(src.shape)}, parameter {tuple(param.shape)}")
            param.copy_(src)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The fp32 parameters of an unsharded (tp = pp = 1) model, keyed as :func:`load_full_state_dict` expects."""
    return {name: p.detach().float().clone() for name, p in unwrap(model).named_parameters()}


def initialize_by_name(model: torch.nn.Module, seed: int) -> None:
    """Give ``model`` (any tp/pp layout) the weights a function of ``seed`` and each parameter's global
    name only, so every layout of one config starts from the same model (Note [Initial weights of
    any layout])."""
    inner = unwrap(model)
    cfg = inner.config
    with torch.no_grad():
        for name, param in inner.named_parameters():
            key = global_name(inner, name)
            if key == "output_layer.weight" and inner.share_embeddings_and_output_weights:
                key = "embedding.word_embeddings.weight"
            full = _initial_value(key, _full_shape(param), cfg, seed)
            param.copy_(shard_of(param, full, gated=is_gated_fc1(inner, key)).to(param.dtype))


def _full_shape(param: torch.Tensor) -> list[int]:
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= parallel_state.get_tensor_model_parallel_world_size()
    return shape


def _initial_value(key: str, shape: list[int], cfg: TransformerConfig, seed: int) -> torch.Tensor:
    """Megatron's default initialisation of parameter ``key``: norms' weights 1, biases 0, the output
    projections of attention and MLP normal with ``std / sqrt(2 * layers)``, other weights normal with
    ``std``; drawn from a generator seeded by ``seed`` and ``key``."""
    if key.endswith("bias"):
        return torch.zeros(shape)
    if "norm" in key.rsplit(".", 2)[-2] or key.endswith("layer_norm_weight"):
        return torch.ones(shape)
    std = cfg.init_method_std
    if key.endswith(("linear_proj.weight", "linear_fc2.weight")):
        std /= math.sqrt(2.0 * cfg.num_layers)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))
    return torch.randn(shape, generator=generator) * std
