"""Which transformers checkpoints Megatron-core's ``GPTModel`` can hold, and the model fields they become.

:func:`model_fields` reads a transformers config (``PretrainedConfig.to_dict()``) of a Llama-family
causal LM and returns the ``model`` section of a ``configs/megatron`` file
(:class:`~megatron_ring.config.gpt.GPTModelConfig`) that builds the same network::

    model_type        llama, qwen2, mistral
    norm              RMSNorm, eps = rms_norm_eps
    MLP               SwiGLU (silu(gate) * up), no bias
    attention         GQA (num_key_value_heads), head_dim, no bias (Qwen2: Q/K/V bias)
    RoPE              rope_theta; rope_type default, linear (Megatron's seq_len_interpolation_factor)
                      or llama3 (Megatron's rope_scaling, with its fixed frequency factors)
    sliding window    Mistral's sliding_window, Qwen2's when every layer slides: window (w - 1, 0)
    embeddings        tied or not (tie_word_embeddings)

Anything else is refused with a ValueError naming the field, its value and what is allowed, before
any tensor is read: an unknown ``model_type``, another activation, biases Megatron cannot place
(Llama's ``attention_bias``, ``mlp_bias``), rope types it cannot build (dynamic, yarn, longrope,
...), a partial rotary factor, a window on some layers only.

Note [Sliding window convention]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
transformers' ``sliding_window = w`` lets the query at position i see the keys j with
``i - w < j <= i``: w keys, itself included. Megatron's (and flash-attn's) ``window_size = (left,
right)`` lets it see ``i - left <= j <= i + right``, so the same band is ``(w - 1, 0)``.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "mistral")
"""The ``model_type`` values :func:`model_fields` converts."""
ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")
"""The ``rope_parameters.rope_type`` values Megatron's ``RotaryEmbedding`` builds."""
LLAMA3_FIXED: dict[str, float] = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 8192}
"""The llama3 RoPE parameters megatron-core's ``RotaryEmbedding._apply_scaling`` fixes (only the factor is free)."""


def model_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """The ``GPTModelConfig`` fields of a transformers Llama / Qwen2 / Mistral config (module docstring).

    ``config``: ``PretrainedConfig.to_dict()`` (transformers 5: RoPE in ``rope_parameters``). Raises
    ValueError naming the first field that cannot be converted.
    """
    kind = config.get("model_type")
    if kind not in ARCHITECTURES:
        raise ValueError(f"model_type = {kind!r} (architectures {config.get('architectures')}) cannot be converted "
                         f"to Megatron-core's GPTModel; allowed: {', '.join(ARCHITECTURES)}")
    _require(config, "hidden_act", "silu", "the SwiGLU MLP of Megatron's gated_linear_unit")
    for flag in ("attention_bias", "mlp_bias"):  # Llama's; Megatron has all-linear or Q/K/V-only biases
        _require(config, flag, False, "Megatron's GPTModel holds biases on every linear or on Q/K/V only")
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    fields: dict[str, Any] = {
        "num_layers": config["num_hidden_layers"], "hidden_size": config["hidden_size"],
        "num_attention_heads": heads, "head_dim": head_dim,
        "num_query_groups": config.get("num_key_value_heads") or heads,
        "ffn_hidden_size": config["intermediate_size"], "vocab_size": config["vocab_size"],
        "seq_length": config["max_position_embeddings"], "position_embedding": "rope",
        "normalization": "RMSNorm", "norm_epsilon": float(config["rms_norm_eps"]), "activation": "swiglu",
        "add_bias_linear": False, "add_qkv_bias": kind == "qwen2",
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        **_rope(config.get("rope_parameters")),
    }
    window = _window(config)
    if window is not None:
        fields["window_size"] = window
    return fields


def _require(config: Mapping[str, Any], field: str, allowed: Any, why: str) -> None:
    value = config.get(field, allowed)
    if value != allowed:
        raise ValueError(f"{field} = {value!r} cannot be converted to Megatron-core's GPTModel ({why}); "
                         f"allowed: {allowed!r}")


def _rope(params: Any) -> dict[str, Any]:
    """``rotary_base`` and ``rope_scaling`` from transformers' ``rope_parameters``."""
    if not isinstance(params, Mapping) or "rope_theta" not in params:
        raise ValueError(f"rope_parameters = {params!r}: expected transformers' mapping with rope_theta "
                         "(and rope_type); a config read by transformers 5 has one")
    rope_type = params.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_parameters.rope_type = {rope_type!r} cannot be built by Megatron-core's "
                         f"RotaryEmbedding; allowed: {', '.join(ROPE_TYPES)}")
    partial = params.get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(f"rope_parameters.partial_rotary_factor = {partial!r} is not converted; allowed: 1.0 "
                         "(RoPE on the whole head)")
    theta = params["rope_theta"]
    if not float(theta).is_integer() or theta < 1:
        raise ValueError(f"rope_parameters.rope_theta = {theta!r}: Megatron's rotary_base is an integer >= 1")
    fields: dict[str, Any] = {"rotary_base": int(theta)}
    if rope_type == "default":
        return fields
    factor = params.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor) or factor < 1:
        raise ValueError(f"rope_parameters.factor = {factor!r} (rope_type {rope_type!r}): expected a number >= 1")
    if rope_type == "llama3":
        for key, fixed in LLAMA3_FIXED.items():
            if params.get(key) != fixed:
                raise ValueError(f"rope_parameters.{key} = {params.get(key)!r} (rope_type 'llama3'): megatron-core's "
                                 f"RotaryEmbedding fixes it to {fixed!r}; allowed: {fixed!r}")
    fields["rope_scaling"] = {"type": rope_type, "factor": float(factor)}
    return fields


def _window(config: Mapping[str, Any]) -> list[int] | None:
    """Megatron's ``window_size`` of a model whose every layer slides, None for full attention
    (Note [Sliding window convention]); ValueError for a window on some layers only."""
    width = config.get("sliding_window")
    types = config.get("layer_types")
    sliding = [width is not None] * config["num_hidden_layers"] if types is None else \
        [kind == "sliding_attention" for kind in types]
    if not any(sliding) or width is None:
        return None
    if not all(sliding):
        raise ValueError(f"layer_types = {types!r}: a sliding window on some layers only cannot be converted "
                         "(Megatron's window_attn_skip_freq makes every N-th layer full, nothing else); allowed: "
                         "the same attention on every layer")
    return [int(width) - 1, 0]


def transformers_fields(fields: Mapping[str, Any], base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A transformers config mapping (``PretrainedConfig.to_dict()`` form) of a GPT of ``fields``, the
    inverse of :func:`model_fields`.

    ``fields``: ``GPTModelConfig`` fields; ``base``: the transformers config the model was converted
    from (its other keys, ``max_position_embeddings``, token ids, ``model_type``, are kept), None for a
    model of random weights (then ``model_type`` is qwen2 with Q/K/V biases, mistral with a window,
    llama otherwise, and ``max_position_embeddings`` is ``seq_length``). ValueError naming the first
    field transformers' Llama / Qwen2 / Mistral cannot hold (LayerNorm, GELU, biases on every linear,
    learned positions, dilation, a window on some layers only).
    """
    get = fields.get
    refusals = [("normalization", "RMSNorm"), ("activation", "swiglu"), ("add_bias_linear", False),
                ("position_embedding", "rope"), ("dilation", None), ("window_attn_skip_freq", None)]
    for field, allowed in refusals:
        if get(field, allowed) != allowed:
            raise ValueError(f"model.{field} = {get(field)!r} has no place in transformers' Llama / Qwen2 / Mistral; "
                             f"allowed: {allowed!r}")
    window = get("window_size")
    if window is not None and (window[1] != 0 or window[0] < 0):
        raise ValueError(f"model.window_size = {window!r}: transformers' sliding_window is (w - 1, 0); allowed: "
                         "[left >= 0, 0]")
    heads = fields["num_attention_heads"]
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(get("rotary_base", 10000))}
    scaling = get("rope_scaling")
    if scaling is not None:
        scaling = dict(scaling)
        rope.update(rope_type=scaling["type"], factor=float(scaling["factor"]))
        if scaling["type"] == "llama3":
            rope.update(LLAMA3_FIXED)
    kind = (base or {}).get("model_type") or ("qwen2" if get("add_qkv_bias") else
                                               "mistral" if window is not None else "llama")
    out: dict[str, Any] = {
        **(base or {"model_type": kind, "architectures": [f"{kind.capitalize()}ForCausalLM"],
                   "max_position_embeddings": fields["seq_length"]}),
        "num_hidden_layers": fields["num_layers"], "hidden_size": fields["hidden_size"],
        "num_attention_heads": heads, "head_dim": get("head_dim") or fields["hidden_size"] // heads,
        "num_key_value_heads": get("num_query_groups") or heads,
        "intermediate_size": fields["ffn_hidden_size"], "vocab_size": fields["vocab_size"],
        "rms_norm_eps": float(get("norm_epsilon", 1e-5)), "hidden_act": "silu",
        "tie_word_embeddings": bool(get("tie_embeddings", False)), "rope_parameters": rope,
        "attention_dropout": float(get("attention_dropout", 0.0)),
    }
    if kind == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    if window is not None:
        out["sliding_window"] = window[0] + 1
    elif kind in ("mistral", "qwen2"):
        out["sliding_window"] = None
    if kind != "qwen2" and get("add_qkv_bias"):
        raise ValueError(f"model.add_qkv_bias = True: transformers' {kind} has no Q/K/V-only biases; allowed: False "
                         "(or a qwen2 checkpoint)")
    return out
