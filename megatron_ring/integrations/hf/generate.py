"""Prefill and generation of a transformers model over a CP group: :func:`ring_forward`, :func:`ring_generate`.

Every rank of the CP group calls these with the same *global* ``input_ids`` and gets the same
result; each rank embeds, projects and attends only its own zigzag shard of the prompt. The
prompt runs as a ring prefill, then transformers' own ``model.generate`` continues from the sharded
:class:`~megatron_ring.integrations.hf.cache.RingCache` (Note [Prefill, replay, decode] there), so
every decoding mode of ``generate`` (greedy, sampling, beam search) and every argument (logits
processors, stopping criteria, streamers, ...) works as in one process. ``use_cache=False`` runs
each step as a ring prefill instead (Note [Generation without a cache] in recompute.py).

Note [Sampling over a CP group]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every rank runs ``generate``'s loop itself and must pick the same tokens, or the ranks' caches and
sequences drift apart silently. The logits are bitwise the same on every rank (decode attention
merges the same gathered partials in the same order on every rank; without a cache they are
broadcast), so greedy and beam search agree by construction. Sampling draws from the default
random generator of the tokens' device, so :func:`ring_generate` checks, before generating, that
this generator's state is the same on every rank (one small all-gather) and raises a ValueError on
every rank otherwise: call ``torch.manual_seed(seed)`` with the same seed on every rank first.
With the same seed the draws also match single-process ``generate``: the prefill consumes no random
numbers and each step makes the same ``multinomial`` call.
"""
from __future__ import annotations

import hashlib
import inspect
from typing import Any

import torch
import torch.distributed as dist
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.generation.utils import GenerateOutput

from megatron_ring.attention.sharding import chunks_per_rank
from megatron_ring.integrations.hf.attention import check_model
from megatron_ring.integrations.hf.cache import RingCache
from megatron_ring.integrations.hf.context import SHARDING, CPContext, cp_context
from megatron_ring.integrations.hf.inputs import (
    check_ids, gather_seq, generate_positions, local_columns, local_inputs, pad_id,
)
from megatron_ring.integrations.hf.packed import is_packed, pack_rows
from megatron_ring.integrations.hf.peer_errors import telling_peers
from megatron_ring.integrations.hf.recompute import ring_prefill_every_call


@torch.no_grad()
def ring_forward(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, *, group: dist.ProcessGroup | None = None,
                 gather_logits: bool = True) -> torch.Tensor:
    """Logits of a causal LM over a sequence sharded across ``group`` (ring attention prefill).

    Call on every rank of ``group`` with the same global ``input_ids`` ``[batch, seq]`` (any length;
    it is left-padded to a multiple of ``2 * cp``), optional padding ``attention_mask`` and
    ``position_ids`` (default ``0..seq-1``, like the model's own forward). Returns the global logits
    ``[batch, seq, vocab]`` on every rank, or with ``gather_logits=False`` this rank's zigzag shard
    of the (padded) sequence ``[batch, seq_padded // cp, vocab]``.

    Packed rows (``position_ids`` that restart inside a row, as transformers' packing collators
    make them, without padding): every document attends only to itself, as if run alone (Note
    [Packed sequences] in packed.py); ``gather_logits=False`` then returns this rank's shard of
    the packed row ``[1, tokens_local, vocab]``.
    """
    check_model(model)
    input_ids, attention_mask = check_ids(input_ids, attention_mask)
    if position_ids is None:
        position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    elif not isinstance(position_ids, torch.Tensor) or position_ids.shape[-1] != input_ids.shape[1] \
            or position_ids.dim() != 2 or position_ids.shape[0] not in (1, input_ids.shape[0]):
        raise ValueError(f"position_ids must be a [batch, seq] tensor like input_ids {tuple(input_ids.shape)}, "
                         f"got {getattr(position_ids, 'shape', type(position_ids))}")
    position_ids = position_ids.expand_as(input_ids)
    if is_packed(position_ids, attention_mask):
        return _packed_forward(model, input_ids, attention_mask, position_ids, group, gather_logits)
    with cp_context(group) as ctx:
        local, pad = local_inputs(model, ctx, input_ids, attention_mask, position_ids)
        with telling_peers(ctx, model):
            logits = model(**local, use_cache=False).logits
        if not gather_logits:
            return logits
        return gather_seq(ctx, logits)[:, pad:]


def _packed_forward(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    position_ids: torch.Tensor, group: dist.ProcessGroup | None, gather_logits: bool) -> torch.Tensor:
    """:func:`ring_forward` of rows of packed documents (Note [Packed sequences] in packed.py)."""
    if not bool(attention_mask.bool().all()):
        raise ValueError("packed rows (position_ids that restart inside a row) with padding in attention_mask are "
                         "not supported; pass packed documents without padding (attention_mask None or all ones)")
    with cp_context(group) as ctx:
        row = pack_rows(input_ids, position_ids, chunks_per_rank(SHARDING) * ctx.size, pad_id(model))
        ctx.cu_seqlens = row.cu_seqlens
        local_ids, local_pos = row.shard(ctx.rank, ctx.size)
        with telling_peers(ctx, model):
            logits = model(input_ids=local_ids, position_ids=local_pos, use_cache=False).logits
        if not gather_logits:
            return logits
        return gather_seq(ctx, logits)[0, row.index]


MANAGED = ("cache", "past_key_values", "position_ids", "inputs_embeds", "assistant_model")
"""``generate`` arguments that :func:`ring_generate` sets itself or cannot shard."""
MODES = ("greedy_search", "sample", "beam_search", "beam_sample")
"""The ``GenerationMode`` values that :func:`ring_generate` runs (``generate``'s built-in loops)."""
DEFAULT_NEW_TOKENS = 20  # generate's own default when neither max_new_tokens nor max_length is set
EXPLICIT = frozenset(inspect.signature(GenerationMixin.generate).parameters) - {"self", "kwargs", "generation_config"}
"""``generate``'s named parameters (streamer, logits_processor, ...), which are not generation-config fields."""


def _generation_config(model: PreTrainedModel, generation_config: GenerationConfig | None,
                       kwargs: dict[str, Any]) -> GenerationConfig:
    """The generation config ``generate`` will use for these arguments, checked for what the ring supports."""
    for name in MANAGED:
        if kwargs.get(name) is not None:
            raise ValueError(f"ring_generate does not take {name!r} (it manages the cache, positions and inputs "
                             f"itself); got {name}={type(kwargs[name]).__name__}")
    config_kwargs = {k: v for k, v in kwargs.items() if k not in EXPLICIT}
    config, _ = model._prepare_generation_config(generation_config, **config_kwargs)  # generate's own merge
    mode = config.get_generation_mode().value
    if mode not in MODES:
        raise ValueError(f"ring_generate does not support generation mode {mode!r} (assisted decoding needs a cache "
                         f"that can be cropped; the others are Hub recipes); allowed: {list(MODES)}")
    if config.prefill_chunk_size is not None:
        raise ValueError(f"prefill_chunk_size={config.prefill_chunk_size!r} is not supported with ring_generate (the "
                         "prompt runs as one ring prefill); allowed: None")
    if config.use_cache is not False and config.cache_implementation is not None:
        raise ValueError(f"ring_generate brings its own sharded cache; got cache_implementation="
                         f"{config.cache_implementation!r}, allowed: None")
    for name in ("output_attentions", "output_hidden_states"):
        if getattr(config, name):
            raise ValueError(f"{name}=True is not supported with ring_generate (attention weights are never "
                             "materialised; hidden states are sharded); allowed: False")
    return config


def _digest(*parts: Any) -> str:
    """A short digest of tensors (their values, dtype and shape) and strings."""
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, torch.Tensor):
            h.update(f"{part.dtype}{tuple(part.shape)}".encode())
            h.update(part.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        else:
            h.update(str(part).encode())
    return h.hexdigest()[:16]


def _check_same_call(ctx: CPContext, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     config: GenerationConfig) -> None:
    """Raise ValueError on every rank unless every rank of the CP group passed the same prompt,
    padding and generation arguments (and, when sampling, has the same random state): one small
    all-gather. Without it, different prompts of one shape give wrong tokens and different
    ``max_new_tokens`` leave ranks waiting in a collective."""
    if ctx.size == 1:
        return
    device = input_ids.device
    parts = {"the prompt (input_ids)": _digest(input_ids), "the padding (attention_mask)": _digest(attention_mask),
             "the generation arguments": _digest(config.to_json_string(use_diff=True))}
    if config.do_sample:
        state = torch.get_rng_state() if device.type == "cpu" else torch.get_device_module(device).get_rng_state(device)
        parts["the random state"] = _digest(state)
    gathered: list[dict[str, str] | None] = [None] * ctx.size
    dist.all_gather_object(gathered, parts, group=ctx.group)
    problems = []
    for what in parts:
        groups: dict[str, list[int]] = {}
        for rank, got in enumerate(gathered):
            groups.setdefault(got[what] if got else "", []).append(rank)
        if len(groups) > 1:
            verb = "differ" if what.endswith("arguments") else "differs"
            problems.append(f"{what} {verb}: CP ranks {sorted(groups.values())} agree among themselves only")
    if problems:
        hint = (" Sampling needs torch.manual_seed(seed) with the same seed on every rank before ring_generate "
                "(Note [Sampling over a CP group])." if any("random" in p for p in problems) else "")
        raise ValueError("ring_generate needs the same call on every rank of the CP group: " + "; ".join(problems)
                         + "." + hint)


def _prefill_cache(model: PreTrainedModel, ctx: CPContext, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   expand: int) -> RingCache:
    """Ring-prefill the prompt into a new :class:`RingCache`, forget its last token, repeat rows ``expand`` times."""
    local, pad = local_inputs(model, ctx, input_ids, attention_mask, generate_positions(attention_mask))
    seq = input_ids.shape[1]
    cache = RingCache(model.config.get_text_config().num_hidden_layers, ctx.rank, ctx.size)
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    columns = local_columns(ctx, seq + pad, input_ids.device) - pad  # the padding gets negative columns: dropped
    with cache.prefill(columns, seq), telling_peers(ctx, model):
        model(**local, cache=cache, use_cache=True, **extra)
    cache.forget_last()
    if expand > 1:  # generate repeats input_ids and mask for beams / return sequences, not a cache it is given
        cache.batch_repeat_interleave(expand)
    cache.start_decode()
    return cache


@torch.no_grad()
def ring_generate(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                  group: dist.ProcessGroup | None = None, generation_config: GenerationConfig | None = None,
                  **kwargs: Any) -> GenerateOutput | torch.Tensor:
    """``model.generate`` with a ring-attention prefill and a KV cache sharded over ``group``.

    Call on every rank of ``group`` with the same global prompt ``input_ids`` ``[batch, seq]`` and
    optional padding ``attention_mask`` (left padding; default: all ones). ``generation_config`` and
    every other keyword argument go to ``generate`` unchanged: ``max_new_tokens``, ``do_sample``,
    ``temperature``, ``top_k``, ``top_p``, ``num_beams``, ``num_return_sequences``, ``use_cache``,
    ``logits_processor``, ``stopping_criteria``, ``streamer``, ``return_dict_in_generate``, ... .
    Returns what ``generate`` returns (``[batch * n, seq + new]`` ids, or its output object),
    identical on every rank and equal to the single-process ``generate``. Sampling needs the same
    seed on every rank (Note [Sampling over a CP group]); a streamer may be given on one rank only.
    """
    check_model(model)
    input_ids, attention_mask = check_ids(input_ids, attention_mask)
    config = _generation_config(model, generation_config, kwargs)
    with cp_context(group) as ctx:
        _check_same_call(ctx, input_ids, attention_mask, config)
        ctx.generating = True
        if config.use_cache is False:
            with ring_prefill_every_call(model, ctx), telling_peers(ctx, model):
                return model.generate(input_ids, attention_mask=attention_mask, generation_config=generation_config,
                                      **kwargs)
        expand = max(config.num_beams or 1, config.num_return_sequences or 1)
        ctx.cache = _prefill_cache(model, ctx, input_ids, attention_mask, expand)
        ctx.phase = "decode"
        with telling_peers(ctx, model):
            return model.generate(input_ids, attention_mask=attention_mask, cache=ctx.cache,
                                  generation_config=generation_config, **kwargs)
