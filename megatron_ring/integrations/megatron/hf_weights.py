"""A transformers Llama / Qwen2 / Mistral state dict as the unsharded state dict of Megatron-core's GPTModel.

::

    weights = HFWeights(hf_model.config.to_dict(), hf_model.state_dict())   # checks names and shapes
    weights = HFWeights(config, SafetensorsTensors.of(directory))            # or read from the files
    load_full_state_dict(model, weights)   # this rank's TP shard and PP stage (integrations/megatron/model.py)

:class:`HFWeights` is a read-only mapping from Megatron's global parameter names (tp = pp = 1) to
tensors, each built from the checkpoint's tensors when first read, so a pipeline stage converts its
own layers only; :meth:`HFWeights.tp_slice` builds one TP rank's slice of a tensor from the slices of
the checkpoint's tensors it is made of (Note [TP slices of fused tensors]), so that read from the
files (:class:`~megatron_ring.integrations.megatron.tensor_source.SafetensorsTensors`) a rank reads
only what it keeps. The architecture is checked by
:func:`~megatron_ring.integrations.megatron.hf_config.model_fields`; every tensor's presence and
shape is checked when the mapping is made, before anything is converted: a missing tensor, one of
the wrong shape, or one the conversion has no place for is a ValueError naming it.

Note [Fused QKV per query group]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Megatron's ``linear_qkv`` holds one block of rows per K/V head (query group) ``g``: the
``heads / groups`` query heads of that group, then its key head, then its value head::

    [q(g0,h0) q(g0,h1) k(g0) v(g0) | q(g1,h2) q(g1,h3) k(g1) v(g1) | ...]      (rows of head_dim each)

transformers keeps ``q_proj``, ``k_proj``, ``v_proj`` apart, query heads in order (head h belongs to
group ``h // (heads / groups)``). Because whole groups are contiguous, the contiguous TP split of the
fused matrix gives each TP rank ``groups / tp`` complete groups: its query heads with their own K/V.
Q/K/V biases (Qwen2) are fused the same way. RoPE needs no permutation: transformers' checkpoints
rotate the two halves of a head (``rotate_half``), as Megatron's non-interleaved RoPE does.

Note [TP slices of fused tensors]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
TP rank ``r`` of ``t`` keeps the ``r``-th contiguous chunk of a column-parallel tensor (dim 0) and of a
row-parallel one (dim 1), except fc1 (Note [Gated fc1 shards] in ``model.py``). Each is a fusion of
contiguous slices of the checkpoint's tensors:

* ``linear_qkv``: chunk ``r`` holds the whole query groups ``r G/t .. (r+1) G/t - 1``, i.e. chunk ``r``
  of ``q_proj``, of ``k_proj`` and of ``v_proj``, fused per group (``G/t`` groups);
* ``linear_fc1``: ``[chunk r of gate_proj; chunk r of up_proj]``;
* everything else: chunk ``r`` of its one tensor (rows, or columns of ``o_proj`` / ``down_proj``).

So a rank reads ``1/t`` of each tensor it owns and never the whole.
"""
from __future__ import annotations

from typing import Any, Iterator, Mapping, Optional

import torch

from megatron_ring.integrations.megatron.hf_config import model_fields
from megatron_ring.integrations.megatron.tensor_source import TensorDict, TensorSource


class HFWeights(Mapping[str, torch.Tensor]):
    """Megatron's global parameter name -> its unsharded tensor, made from a transformers state dict.

    ``config``: ``PretrainedConfig.to_dict()``; ``tensors``: the model's ``state_dict()`` (with tied
    embeddings it may or may not list ``lm_head.weight``; Megatron's output layer then reads the
    embedding), or a :class:`TensorSource` of the same names (safetensors files, read when asked).
    Values are float32. Raises ValueError for an architecture :func:`model_fields` refuses and for a
    missing, misshapen or unused tensor (names and shapes only: nothing is read).
    """

    def __init__(self, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor] | TensorSource) -> None:
        self.fields = model_fields(config)
        self.source: TensorSource = tensors if isinstance(tensors, TensorSource) else TensorDict(tensors)
        names = set(self.source.keys())
        self.sources, shapes = _layout(self.fields)
        for name, shape in shapes.items():
            if name not in names:
                owner = next(key for key, parts in self.sources.items() if name in parts)
                raise ValueError(f"checkpoint tensor {name!r} is missing: Megatron's {owner} is made of "
                                 f"{list(self.sources[owner])}")
            if self.source.shape(name) != shape:
                raise ValueError(f"checkpoint tensor {name!r} has shape {self.source.shape(name)}; the config "
                                 f"({config.get('model_type')}) gives {shape}")
        ignorable = {"lm_head.weight"} if self.fields["tie_embeddings"] else set()
        unused = sorted(names - set(shapes) - ignorable)
        if unused:
            raise ValueError(f"checkpoint tensors {unused} have no place in Megatron's GPTModel of this config "
                             f"(model_type {config.get('model_type')!r}); they would be dropped")

    def __getitem__(self, key: str) -> torch.Tensor:
        parts = [self.source.read(name) for name in self.sources[key]]
        if key.endswith(("linear_qkv.weight", "linear_qkv.bias")):
            return fused_qkv(*parts, groups=self.fields["num_query_groups"])
        return torch.cat(parts) if len(parts) > 1 else parts[0]  # fc1: [gate; up] (Note [Gated fc1 shards])

    def tp_slice(self, key: str, *, dim: int, parts: int, index: int, gated: bool,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``self[key].chunk(parts, dim)[index]`` (for a ``gated`` fc1: chunk ``index`` of each half, Note [Gated
        fc1 shards]), read as slices of the checkpoint's tensors only (Note [TP slices of fused tensors]); with
        ``out`` (a parameter) copied into it, a slice of one tensor read straight into it. ValueError when ``out``
        has another shape."""
        names = self.sources[key]
        if len(names) == 1:
            return self._chunk(names[0], dim, parts, index, out)
        groups = self.fields["num_query_groups"]
        if key.endswith(("linear_qkv.weight", "linear_qkv.bias")) and dim == 0 and groups % parts == 0:
            result = fused_qkv(*(self._chunk(name, 0, parts, index) for name in names), groups=groups // parts)
        elif gated and dim == 0 and not key.endswith(("linear_qkv.weight", "linear_qkv.bias")):
            result = torch.cat([self._chunk(name, 0, parts, index) for name in names])
        else:
            result = self[key].chunk(parts, dim)[index]
        if out is None:
            return result
        if out.shape != result.shape:
            raise ValueError(f"the TP slice of {key!r} has shape {tuple(result.shape)}, its destination "
                             f"{tuple(out.shape)}")
        return out.copy_(result)

    def _chunk(self, name: str, dim: int, parts: int, index: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``tensor.chunk(parts, dim)[index]`` of checkpoint tensor ``name``, read alone (into ``out``)."""
        size = self.source.shape(name)[dim]
        step = -(-size // parts)
        start = min(size, index * step)
        return self.source.read(name, dim, start, min(size, start + step), out=out)

    def __contains__(self, key: object) -> bool:
        return key in self.sources

    def __iter__(self) -> Iterator[str]:
        return iter(self.sources)

    def __len__(self) -> int:
        return len(self.sources)


def fused_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, groups: int) -> torch.Tensor:
    """Megatron's ``linear_qkv`` rows from separate Q, K, V rows (Note [Fused QKV per query group]);
    weights ``[rows, hidden]`` or biases ``[rows]``."""
    per_group = [t.reshape(groups, -1, *t.shape[1:]) for t in (q, k, v)]
    return torch.cat(per_group, dim=1).reshape(-1, *q.shape[1:])


def _layout(fields: Mapping[str, Any]) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[int, ...]]]:
    """(Megatron name -> the checkpoint tensors it is made of, in order; checkpoint tensor -> its shape)."""
    h, vocab, ffn = fields["hidden_size"], fields["vocab_size"], fields["ffn_hidden_size"]
    q_rows = fields["num_attention_heads"] * fields["head_dim"]
    kv_rows = fields["num_query_groups"] * fields["head_dim"]
    sources: dict[str, tuple[str, ...]] = {"embedding.word_embeddings.weight": ("model.embed_tokens.weight",),
                                           "decoder.final_layernorm.weight": ("model.norm.weight",)}
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    if not fields["tie_embeddings"]:
        sources["output_layer.weight"] = ("lm_head.weight",)
        shapes["lm_head.weight"] = (vocab, h)
    for i in range(fields["num_layers"]):
        ours, theirs = f"decoder.layers.{i}.", f"model.layers.{i}."
        attn, mlp = theirs + "self_attn.", theirs + "mlp."
        layer = {
            "input_layernorm.weight": {theirs + "input_layernorm.weight": (h,)},
            "self_attention.linear_qkv.weight": {attn + "q_proj.weight": (q_rows, h), attn + "k_proj.weight": (kv_rows, h),
                                                 attn + "v_proj.weight": (kv_rows, h)},
            "self_attention.linear_proj.weight": {attn + "o_proj.weight": (h, q_rows)},
            "pre_mlp_layernorm.weight": {theirs + "post_attention_layernorm.weight": (h,)},
            "mlp.linear_fc1.weight": {mlp + "gate_proj.weight": (ffn, h), mlp + "up_proj.weight": (ffn, h)},
            "mlp.linear_fc2.weight": {mlp + "down_proj.weight": (h, ffn)},
        }
        if fields["add_qkv_bias"]:
            layer["self_attention.linear_qkv.bias"] = {attn + "q_proj.bias": (q_rows,), attn + "k_proj.bias": (kv_rows,),
                                                       attn + "v_proj.bias": (kv_rows,)}
        for name, parts in layer.items():
            sources[ours + name] = tuple(parts)
            shapes.update(parts)
    return sources, shapes


def hf_tensors(fields: Mapping[str, Any], full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :class:`HFWeights`: a transformers state dict from Megatron's unsharded one.

    ``fields``: the ``GPTModelConfig`` fields of the model (:func:`model_fields` of its transformers
    config); ``full``: Megatron's global parameter name (tp = pp = 1) -> tensor, every name the
    conversion makes (``output_layer.weight`` only when the embeddings are not tied). The fused
    ``linear_qkv`` is split per query group (Note [Fused QKV per query group]), ``linear_fc1`` into
    gate and up; with tied embeddings no ``lm_head.weight`` is written (transformers ties it).
    ValueError naming a missing tensor or one of the wrong shape.
    """
    sources, shapes = _layout(fields)
    out: dict[str, torch.Tensor] = {}
    for key, names in sources.items():
        if key not in full:
            raise ValueError(f"Megatron tensor {key!r} is missing; it becomes {list(names)}")
        tensor = full[key]
        if key.endswith(("linear_qkv.weight", "linear_qkv.bias")):
            parts = split_qkv(tensor, groups=fields["num_query_groups"], q_rows=shapes[names[0]][0])
        elif len(names) > 1:
            parts = tensor.chunk(len(names))
        else:
            parts = (tensor,)
        for name, part in zip(names, parts):
            if tuple(part.shape) != shapes[name]:
                raise ValueError(f"Megatron tensor {key!r} has shape {tuple(tensor.shape)}: its part {name!r} is "
                                 f"{tuple(part.shape)}, the config gives {shapes[name]}")
            out[name] = part.contiguous()
    return out


def split_qkv(fused: torch.Tensor, *, groups: int, q_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q, K, V rows from Megatron's ``linear_qkv`` rows, the inverse of :func:`fused_qkv`;
    weights ``[rows, hidden]`` or biases ``[rows]``."""
    per_group = fused.reshape(groups, -1, *fused.shape[1:])
    q_per_group = q_rows // groups
    kv_per_group = (per_group.shape[1] - q_per_group) // 2
    q, k, v = per_group.split([q_per_group, kv_per_group, kv_per_group], dim=1)
    return tuple(t.reshape(-1, *fused.shape[1:]) for t in (q, k, v))  # type: ignore[return-value]


def megatron_names(fields: Mapping[str, Any]) -> list[str]:
    """Megatron's global parameter names (tp = pp = 1) of the model of ``fields``, those :class:`HFWeights` makes."""
    return list(_layout(fields)[0])
