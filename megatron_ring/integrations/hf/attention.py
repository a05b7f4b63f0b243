"""The ``"ring"`` entries of transformers' ``AttentionInterface`` and ``AttentionMaskInterface``.

Note [Padding]
~~~~~~~~~~~~~~
The core's ``key_padding_mask`` runs on ``math`` and ``sdpa`` (an additive bias; on CUDA not yet run on
a GPU) but not on ``flash_attn``, so this adapter applies padding in a way every kernel takes, exactly,
by one extra head dimension: queries get a 1, keys get 0 (kept) or ``-big`` (padding),
values get 0, so a padded key's score is ``score - scale * big`` and its softmax weight underflows
to exactly 0 (real keys' scores gain an exact 0). The extra dims are padded with zeros to keep
``head_dim`` a multiple of 8 for the fused kernels. It runs only for batches that have padding, and
costs one copy of q/k/v (of the local cache, per decode step). Prompts whose length is not a
multiple of ``2 * cp`` are left-padded the same way.

Note [Length-dependent RoPE]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
transformers' ``dynamic`` (dynamic NTK) and ``longrope`` (Phi-3) RoPE choose their frequencies
inside the rotary embedding's forward from ``max(position_ids) + 1`` of that call
(``dynamic_rope_update``). Under the ring each rank's forward sees only its shard's positions, so
ranks whose largest position is below the global one rotate with other frequencies than the
single-process model: wrong logits, no error. Computing it right needs the global length in that
forward, and transformers offers no way in: the models compute ``position_embeddings`` from
``position_ids`` themselves (no argument to pass them), and priming the module with a global-length
call does not stick (``dynamic`` resets to the original frequencies when a call's length is below
``max_position_embeddings``; ``longrope`` re-decides on every call). So :func:`check_model` refuses
these rope types; the others (``default``, ``linear``, ``llama3``, ``yarn``, ...) fix their
frequencies from the config at load and are exact at global positions.

Note [Refusing at load]
~~~~~~~~~~~~~~~~~~~~~~~
Once ``"ring"`` is registered, transformers accepts ``attn_implementation="ring"`` for every model
class, also for those whose attention never calls ``AttentionInterface`` (Bloom would run its own
attention on each rank's shard alone: wrong logits, no error; Falcon would fail later with a bare
``KeyError: 'ring'``). transformers has no per-model hook at load. The one place that sees both the
model class and the requested implementation is ``PreTrainedModel._check_and_adjust_attn_implementation``,
which ``__init__`` (so ``from_pretrained`` and ``from_config``) and ``set_attn_implementation`` call,
so :func:`register` wraps it: a ``"ring"`` request runs :func:`check_model` first and a model that
cannot run the ring fails at load with the reason and its class name. Every other request goes
through unchanged.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from transformers import AttentionInterface, GenerationMixin, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

from megatron_ring.attention.decode import decode_attention, decode_attention_rows
from megatron_ring.attention.api import ring_attention
from megatron_ring.attention.turn import turn_attention
from megatron_ring.integrations.hf.context import ATTN_IMPLEMENTATION, SHARDING, CPContext, active, generating
from megatron_ring.integrations.hf.shard_check import check_shard_positions


def _big(scale: float, dtype: torch.dtype) -> float:
    """Padding bias: makes ``exp(scale * (score - big))`` exactly 0 without overflowing ``dtype``."""
    return min(1e4 / scale, torch.finfo(dtype).max / 8)


def _mask_keys(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor,
               scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold a key mask (bool ``[batch, s_k]``, True = attend) into extra head dims (Note [Padding]).

    q ``[b, s_q, hq, d]``, k/v ``[b, s_k, hkv, d]`` -> the same with ``d + e``, ``e`` in 1..8 so that
    ``d + e`` stays a multiple of 8 (fused kernels need it). Only the first extra dim is non-zero.
    """
    extra = 8 - q.shape[-1] % 8
    q_extra = q.new_zeros(q.shape[:-1] + (extra,))
    q_extra[..., 0] = 1
    k_extra = k.new_zeros(k.shape[:-1] + (extra,))
    k_extra[..., 0].masked_fill_(~key_mask.to(k.device)[:, :, None], -_big(scale, k.dtype))
    return (torch.cat([q, q_extra], dim=-1), torch.cat([k, k_extra], dim=-1),
            torch.cat([v, v.new_zeros(v.shape[:-1] + (extra,))], dim=-1))


def _check_module_call(module: torch.nn.Module, dropout: float, kwargs: dict[str, Any]) -> tuple[int, int]:
    """Refuse what the ring cannot compute; return the core's ``window_size`` for this layer.

    transformers' ``sliding_window=W`` lets a query see itself and the ``W - 1`` tokens before it
    (``kv_idx > q_idx - W``), which is the core's causal ``window_size=(W - 1, 0)``.
    """
    if kwargs.get("output_attentions"):
        raise ValueError("output_attentions=True is not supported with ring attention (weights are never materialised)")
    if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        raise ValueError("ring attention for transformers supports causal decoders only, got is_causal=False")
    if dropout:
        raise ValueError(f"attention dropout must be 0 with ring attention, got {dropout} (call model.eval())")
    for name in ("softcap", "s_aux", "sinks"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{name}={kwargs[name]!r} is not supported with ring attention; allowed: None")
    window = kwargs.get("sliding_window")
    if window is None:
        return (-1, -1)
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window={window!r} must be None or an int >= 1")
    return (window - 1, 0)


def ring_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                           **kwargs: Any) -> tuple[torch.Tensor, None]:
    """``AttentionInterface`` entry ``"ring"``.

    query ``[batch, heads_q, q_len, head_dim]``, key/value ``[batch, heads_kv, kv_len, head_dim]``
    (this rank's tokens), attention_mask the 2-D padding mask from :func:`ring_mask` or None.
    Returns ``([batch, q_len, heads_q, head_dim], None)``. Whether a mask is given must agree on all
    ranks (the wrappers pass None exactly when the global mask has no padding): the masked path
    changes the shapes that the ranks exchange.
    """
    ctx = active()
    if not torch.compiler.is_compiling():  # Note [Counting under torch.compile]
        ctx.in_attention = True  # from here an error is raised alike on every rank, or reported by the core
    window = _check_module_call(module, dropout, kwargs)
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    if ctx.phase == "decode" and ctx.cache is None:
        raise ValueError("the decode phase needs the RingCache of the running generate in the CP context")
    if ctx.phase == "prefill" and k.shape[1] != q.shape[1]:
        raise ValueError(f"a ring prefill got {q.shape[1]} local queries but {k.shape[1]} keys: a KV cache that "
                         "ring_generate did not build (model.generate inside a bare cp_context?); generate with "
                         "megatron_ring.hf.ring_generate")
    if ctx.cu_seqlens is not None:
        return _returned(ctx, _packed_prefill(ctx, q, k, v, attention_mask, scale, window)), None
    if ctx.phase == "decode_rows":
        layers = [cache.layers[module.layer_idx] for cache in ctx.rows]
        shards = [(layer.keys.transpose(1, 2), layer.values.transpose(1, 2)) for layer in layers]
        positions = {} if window == (-1, -1) else {
            "q_positions": torch.tensor([[layer.seen - 1] for layer in layers], device=q.device),
            "k_positions": [layer.columns for layer in layers]}
        out = decode_attention_rows(q, shards, ctx.group, softmax_scale=scale, window_size=window, **positions)
        return _returned(ctx, out), None
    if ctx.phase == "turn":
        if ctx.cache is None or ctx.turn_positions is None or attention_mask is not None:
            raise ValueError("the turn phase needs the conversation's RingCache and the turn's positions in the CP "
                             "context, and no padding mask; run turns through megatron_ring.hf.ring_extend")
        columns = ctx.cache.layers[module.layer_idx].columns
        n = ctx.turn_positions.numel()  # q_len > n: the placeholder token of a rank without new tokens
        out = turn_attention(q[:, :n], k, v, ctx.group, q_positions=ctx.turn_positions, k_positions=columns,
                             mode=ctx.turn_mode, softmax_scale=scale, window_size=(window[0], 0))
        if n < q.shape[1]:
            out = torch.cat([out, out.new_zeros(out.shape[0], q.shape[1] - n, *out.shape[2:])], dim=1)
        return _returned(ctx, out), None
    if ctx.phase == "prefill" and not ctx.sharded and getattr(module, "layer_idx", 0) == 0:
        check_shard_positions(ctx, kwargs.get("position_ids"), attention_mask, q.shape[0], q.shape[1])
    key_mask = attention_mask
    columns = ctx.cache.layers[module.layer_idx].columns if ctx.phase == "decode" else None
    if key_mask is not None:
        if key_mask.dim() != 2:
            raise ValueError(f"ring attention takes a 2-D padding mask [batch, seq], got shape {tuple(key_mask.shape)}")
        if ctx.phase == "decode":
            key_mask = key_mask[:, columns.to(key_mask.device)] if columns is not None else key_mask[:, :0]
    d = q.shape[-1]
    if key_mask is not None:
        q, k, v = _mask_keys(q, k, v, key_mask.bool(), scale)
    if ctx.phase == "decode":
        positions = _decode_positions(ctx, module.layer_idx, q.shape[1], columns, q.device) if window != (-1, -1) else {}
        layer = ctx.cache.layers[module.layer_idx]
        compiling = torch.compiler.is_compiling()  # compiled steps always check: Note [Counting under torch.compile]
        out = decode_attention(q, k, v, ctx.group, softmax_scale=scale, window_size=window,
                               check_consistency=compiling or not layer.agreed, **positions)  # Note [Decode handshake once]
        if not compiling:
            layer.agreed = True
    else:
        out = ring_attention(q, k, v, ctx.group, causal=True, softmax_scale=scale, sharding=SHARDING,
                             window_size=window)
    return _returned(ctx, out[..., :d]), None


def _returned(ctx: CPContext, out: torch.Tensor) -> torch.Tensor:
    """``out``, once the attention call is counted as done (Note [A model error on one rank] in peer_errors.py).

    Note [Counting under torch.compile]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    Dynamo guards on every Python value a compiled frame reads: a call counter read and bumped in
    the attention function made each decode step a new graph, and the decode handshake's per-layer
    flag would add one more. So a traced call only marks the context ``compiled`` (a write, which
    is not guarded); it neither counts nor skips the decode handshake, and an error in a compiled
    forward is not sent to the other ranks (they wait for the collective timeout, as before).
    """
    if torch.compiler.is_compiling():
        ctx.compiled = True
    else:
        ctx.in_attention = False
        ctx.attention_calls += 1
    return out


def _decode_positions(ctx: CPContext, layer_idx: int, q_len: int, columns: torch.Tensor | None,
                      device: torch.device) -> dict[str, torch.Tensor]:
    """Global token indices of the decode queries (the last ``q_len`` seen) and of the local cache entries."""
    seen = ctx.cache.layers[layer_idx].seen
    k_positions = columns.to(device) if columns is not None else torch.empty(0, dtype=torch.long, device=device)
    return {"q_positions": torch.arange(seen - q_len, seen, device=device), "k_positions": k_positions}


def _packed_prefill(ctx: CPContext, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    attention_mask: torch.Tensor | None, scale: float, window: tuple[int, int]) -> torch.Tensor:
    """One packed row ``[1, t, heads, dim]`` of documents (Note [Packed sequences] in packed.py) -> same shape."""
    if ctx.phase != "prefill" or q.shape[0] != 1 or attention_mask is not None:
        raise ValueError(
            f"a packed call (cp_context(cu_seqlens=...)) runs one prefill row without a padding mask; got phase "
            f"{ctx.phase!r}, batch {q.shape[0]}, attention_mask {'given' if attention_mask is not None else 'None'}"
        )
    out = ring_attention(q[0], k[0], v[0], ctx.group, causal=True, softmax_scale=scale, sharding=SHARDING,
                         window_size=window, cu_seqlens=ctx.cu_seqlens)
    return out[None]


def ring_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
              mask_function: Any = None, attention_mask: torch.Tensor | None = None,
              **kwargs: Any) -> torch.Tensor | None:
    """``AttentionMaskInterface`` entry ``"ring"``: hand the 2-D padding mask through unchanged.

    The causal structure lives in the ring (on global positions), so only padding is needed: in
    prefill the mask is this rank's shard ``[batch, seq_local]``, in decode the global mask
    ``[batch, seen + 1]`` that ``generate`` keeps (the attention function picks the local columns).
    """
    return attention_mask


def register() -> None:
    """Register ``"ring"`` with transformers' ``AttentionInterface`` and ``AttentionMaskInterface``, and
    refuse it at load for models that cannot run it (Note [Refusing at load]); idempotent."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, ring_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, ring_mask)
    checker = PreTrainedModel._check_and_adjust_attn_implementation
    if not getattr(checker, "_refuses_ring", False):
        PreTrainedModel._check_and_adjust_attn_implementation = _refusing_ring(checker)
    if not getattr(GenerationMixin.generate, "_refuses_ring", False):
        GenerationMixin.generate = _refusing_bare_generate(GenerationMixin.generate)


def _refusing_ring(checker: Callable[..., str]) -> Callable[..., str]:
    """``checker`` (transformers' check of a requested ``attn_implementation``), preceded for ``"ring"``
    by :func:`check_model`."""
    @functools.wraps(checker)
    def check(self: PreTrainedModel, attn_implementation: Any, *args: Any, **kwargs: Any) -> str:
        if attn_implementation == ATTN_IMPLEMENTATION:
            check_model(self, require_ring=False)
        return checker(self, attn_implementation, *args, **kwargs)
    check._refuses_ring = True  # type: ignore[attr-defined]
    return check


def _refusing_bare_generate(generate: Callable[..., Any]) -> Callable[..., Any]:
    """``generate``, refused for a ``"ring"`` model unless :func:`ring_generate` runs it.

    Called directly (in a bare ``cp_context``), ``generate`` picks each rank's next token from the
    last position of that rank's shard: wrong tokens, different on each rank. Its second step
    failed on a shape check, but ``max_new_tokens=1`` has none. Every rank raises the same error.
    """
    @functools.wraps(generate)
    def checked(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(self.config, "_attn_implementation", None) == ATTN_IMPLEMENTATION and not generating():
            raise ValueError(
                f"model.generate on a model with attn_implementation={ATTN_IMPLEMENTATION!r} must run through "
                "megatron_ring.hf.ring_generate(model, input_ids, ...) with the global prompt on every rank: called "
                "directly it would take each rank's next token from the end of that rank's own shard"
            )
        return generate(self, *args, **kwargs)
    checked._refuses_ring = True  # type: ignore[attr-defined]
    return checked


register()


def enable_ring_attention(model: PreTrainedModel) -> PreTrainedModel:
    """Switch ``model`` to ``attn_implementation="ring"`` after checking that it can run it; return it."""
    check_model(model, require_ring=False)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model


def check_model(model: PreTrainedModel, *, require_ring: bool = True) -> None:
    """Raise unless ``model`` computes exactly under the ring (and, with ``require_ring``, is set to ``"ring"``)."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    name = type(model).__name__
    if not model.is_backend_compatible():
        raise ValueError(
            f"{name} is not supported with ring attention: its attention does not (fully) go through transformers' "
            f"AttentionInterface ({name}._supports_attention_backend is False), so attn_implementation="
            f"{ATTN_IMPLEMENTATION!r} would be ignored or give wrong results"
        )
    config = model.config.get_text_config()
    if config.is_encoder_decoder or not getattr(config, "is_causal", True):
        raise ValueError(f"ring attention supports causal decoder-only models, got {name} "
                         f"(is_encoder_decoder={config.is_encoder_decoder}, is_causal={getattr(config, 'is_causal', True)})")
    for rope_type in _rope_types(config):
        if "dynamic" in rope_type or rope_type == "longrope":  # the types that dynamic_rope_update recomputes
            raise ValueError(
                f"rope_type={rope_type!r} is not supported with ring attention: its frequencies depend on the longest "
                "position id in each forward, and under the ring a rank sees only its own shard's positions; "
                "allowed: rope types with fixed frequencies ('default', 'linear', 'llama3', 'yarn', ...)"
            )
    if getattr(config, "output_attentions", False):
        raise ValueError("config.output_attentions=True is not supported with ring attention; allowed: False")
    _check_attention_fields(config)
    impl = config._attn_implementation
    if require_ring and impl != ATTN_IMPLEMENTATION:
        raise ValueError(
            f"model has attn_implementation={impl!r}; ring_forward / ring_generate need {ATTN_IMPLEMENTATION!r}: "
            f"load it with attn_implementation={ATTN_IMPLEMENTATION!r} or call enable_ring_attention(model)"
        )


LAYER_TYPES: tuple[str, ...] = ("full_attention", "sliding_attention")
"""``config.layer_types`` entries the ring computes exactly (causal full and causal sliding-window layers)."""


def _check_attention_fields(config: Any) -> None:
    """Refuse the attention variants of the config that the ring cannot compute (the field, value, allowed)."""
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        raise ValueError(
            f"config.attn_logit_softcapping={softcap} is not supported with ring attention: none of the ring's block "
            "kernels caps the attention logits (tanh), so the result would differ from the model's; allowed: None"
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("config.use_bidirectional_attention=True is not supported with ring attention (causal "
                         "decoders only); allowed: False")
    other = sorted(set(getattr(config, "layer_types", None) or ()) - set(LAYER_TYPES))
    if other:
        raise ValueError(f"config.layer_types contains {other}, which ring attention does not compute; "
                         f"allowed: {list(LAYER_TYPES)}")


def _rope_types(config: Any) -> set[str]:
    """The ``rope_type`` of every entry of ``config.rope_parameters`` (flat, or nested per layer type)."""
    params = getattr(config, "rope_parameters", None) or {}
    entries = [value for value in params.values() if isinstance(value, dict)] or [params]
    return {entry.get("rope_type", "default") for entry in entries}


