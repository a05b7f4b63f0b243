"""A tiny pure-torch GPT served over a context-parallel group: the reference :class:`ModelRunner`.

It shares no code with Megatron-core, so tests use it as an independent check of the loop, the
metrics, the launcher and of ring prefill + sharded decode: greedy tokens must not depend on
``cp``. Tensor and pipeline parallelism are not supported (``tp = pp = 1``; ``dp`` replicas are
independent). Model config (``model.config`` of a ``"runner": "toy"`` config)::

    {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
     "ffn_hidden_size": 128, "vocab_size": 128}

Pre-norm blocks (RMSNorm, GQA attention with RoPE at global positions, GELU MLP), separate LM head.
Weights are drawn in fp32 on the CPU from ``seed``, so every layout holds the same model.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist
from pydantic import Field

from megatron_ring.attention.decode import decode_attention
from megatron_ring.attention.api import ring_attention
from megatron_ring.attention.sharding import local_positions, shard_sequence
from megatron_ring.config import Problems, StrictModel
from megatron_ring.inference.runners.protocol import DeepSpeedPassThrough, block_kernel_name, refuse_padding
from megatron_ring.parallel.groups import ParallelGroups
from megatron_ring.parallel.layout import ParallelLayout


class ToyModelConfig(StrictModel):
    """Sizes of the toy GPT."""

    num_layers: int = Field(..., ge=1)
    hidden_size: int = Field(..., ge=2)
    num_attention_heads: int = Field(..., ge=1)
    num_query_groups: Optional[int] = Field(None, ge=1, description="K/V heads; None = num_attention_heads")
    ffn_hidden_size: int = Field(..., ge=1)
    vocab_size: int = Field(..., ge=2)
    rope_base: float = Field(10000.0, gt=0)

    @property
    def heads_kv(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def check_model(model: dict[str, Any], layout: ParallelLayout, *, batch: int, prompt_len: int,
                new_tokens: int, dtype: Optional[str]) -> dict[str, Any]:
    """Validate a toy model config for ``layout`` (see :class:`RunnerModule`); it runs in any ``dtype``."""
    where = "toy model config (megatron_ring.model.config)"
    cfg = ToyModelConfig.parse(model, where=where)
    problems = Problems(where=where)
    if layout.tp != 1 or layout.pp != 1:
        problems.add(f"megatron_ring.layout: the toy runner supports tp = pp = 1 only, got {layout.describe()}")
    if cfg.hidden_size % cfg.num_attention_heads or cfg.head_dim % 2:
        problems.add(f"hidden_size = {cfg.hidden_size} must split into num_attention_heads = "
                     f"{cfg.num_attention_heads} heads of an even size (RoPE)")
    if cfg.num_attention_heads % cfg.heads_kv:
        problems.add(f"num_query_groups = {cfg.heads_kv} must divide num_attention_heads = {cfg.num_attention_heads}")
    problems.raise_if_any()
    per_layer = 2 * cfg.hidden_size * cfg.num_attention_heads * cfg.head_dim \
        + 2 * cfg.hidden_size * cfg.heads_kv * cfg.head_dim + 2 * cfg.hidden_size * cfg.ffn_hidden_size
    return {
        "runner": "toy", "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
        "num_attention_heads": cfg.num_attention_heads, "num_query_groups": cfg.heads_kv,
        "ffn_hidden_size": cfg.ffn_hidden_size, "vocab_size": cfg.vocab_size,
        "parameters": cfg.num_layers * per_layer + 2 * cfg.vocab_size * cfg.hidden_size,
    }


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)


def _rope(x: torch.Tensor, pos: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate ``x`` ``[batch, seq, heads, head_dim]`` by the angles of global positions ``pos`` ``[seq]``."""
    half = x.shape[-1] // 2
    freq = base ** (-torch.arange(half, dtype=torch.float64, device=x.device) / half)
    angle = pos.to(torch.float64)[:, None] * freq[None, :]
    cos, sin = angle.cos().to(x.dtype)[None, :, None, :], angle.sin().to(x.dtype)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class ToyGPT(torch.nn.Module):
    """The weights: ``emb [vocab, hidden]``, ``head [hidden, vocab]`` and per layer wq/wk/wv/wo/w1/w2
    as ``[in, out]``."""

    def __init__(self, cfg: ToyModelConfig, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)

        def param(fan_in: int, *shape: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.randn(*shape, generator=gen) / math.sqrt(fan_in), requires_grad=False)

        h, d = cfg.hidden_size, cfg.head_dim
        self.emb = param(1, cfg.vocab_size, h)
        self.head = param(h, h, cfg.vocab_size)
        self.layers = torch.nn.ModuleList()
        for _ in range(cfg.num_layers):
            layer = torch.nn.Module()
            layer.wq = param(h, h, cfg.num_attention_heads * d)
            layer.wk = param(h, h, cfg.heads_kv * d)
            layer.wv = param(h, h, cfg.heads_kv * d)
            layer.wo = param(cfg.num_attention_heads * d, cfg.num_attention_heads * d, h)
            layer.w1 = param(h, h, cfg.ffn_hidden_size)
            layer.w2 = param(cfg.ffn_hidden_size, cfg.ffn_hidden_size, h)
            self.layers.append(layer)


class ToyRunner(DeepSpeedPassThrough):
    """:class:`ModelRunner` of :class:`ToyGPT` over the CP group: ring prefill, sharded decode.

    KV cache per layer: K and V ``[batch, capacity, heads_kv, head_dim]`` with
    ``capacity = prompt_len / cp + ceil((new_tokens - 1) / cp)``; after prefill the first
    ``prompt_len / cp`` slots hold this rank's zigzag shard; decode step ``t`` appends the new
    token's K/V on CP rank ``t % cp`` only.
    """

    def __init__(self, cfg: ToyModelConfig, groups: ParallelGroups, *, dtype: torch.dtype, device: torch.device,
                 seed: int, batch: int, prompt_len: int, new_tokens: int) -> None:
        self.cfg = cfg
        self.groups = groups
        self.dtype = dtype
        self.device = device
        self.vocab_size = cfg.vocab_size
        self.module = ToyGPT(cfg, seed).to(device=device, dtype=dtype)
        self.attention_kernel = block_kernel_name(device, dtype, cfg.head_dim)
        self.cp_rank, self.cp_size = groups.cp_rank, groups.cp_size
        self.capacity = prompt_len // self.cp_size + -(-(new_tokens - 1) // self.cp_size)
        shape = (batch, self.capacity, cfg.heads_kv, cfg.head_dim)
        self._k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self._v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
        self._len = 0
        self._pos = -1
        self._step = 0

    def kv_cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._k + self._v)

    def reset(self) -> None:
        self._len, self._pos, self._step = 0, -1, 0

    def _qkv(self, layer: torch.nn.Module, x: torch.Tensor, pos: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, s, _ = x.shape
        cfg = self.cfg
        h = _rms_norm(x)
        q = (h @ layer.wq).view(b, s, cfg.num_attention_heads, cfg.head_dim)
        k = (h @ layer.wk).view(b, s, cfg.heads_kv, cfg.head_dim)
        v = (h @ layer.wv).view(b, s, cfg.heads_kv, cfg.head_dim)
        return _rope(q, pos, cfg.rope_base), _rope(k, pos, cfg.rope_base), v

    def _finish_layer(self, layer: torch.nn.Module, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = x + attn.flatten(2) @ layer.wo
        return x + torch.nn.functional.gelu(_rms_norm(x) @ layer.w1) @ layer.w2

    def _next_ids(self, x_last: torch.Tensor) -> torch.Tensor:
        """Greedy ids ``[batch]`` from the hidden state of the last token ``[batch, hidden]``."""
        logits = _rms_norm(x_last).float() @ self.module.head.float()
        return logits.argmax(dim=-1)

    @torch.no_grad()
    def prefill(self, prompt_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        refuse_padding('toy', attention_mask)
        b, length = prompt_ids.shape
        if b > self._k[0].shape[0] or length // self.cp_size > self.capacity:
            raise ValueError(f"prompt {tuple(prompt_ids.shape)} exceeds the KV cache built for "
                             f"batch {self._k[0].shape[0]}, capacity {self.capacity} tokens per rank")
        ids = shard_sequence(prompt_ids.to(self.device), self.cp_rank, self.cp_size)
        pos = local_positions(length, self.cp_rank, self.cp_size, device=self.device)
        x = self.module.emb[ids]
        s_local = ids.shape[1]
        for i, layer in enumerate(self.module.layers):
            q, k, v = self._qkv(layer, x, pos)
            self._k[i][:b, :s_local] = k
            self._v[i][:b, :s_local] = v
            x = self._finish_layer(layer, x, ring_attention(q, k, v, self.groups.cp, causal=True))
        self._len, self._pos, self._step = s_local, length, 0
        # Zigzag puts the last global token (chunk 2P-1) last on CP rank 0.
        nxt = self._next_ids(x[:, -1])
        if self.cp_size > 1:
            dist.broadcast(nxt, src=self.groups.ranks["cp"][0], group=self.groups.cp)
        return nxt

    @torch.no_grad()
    def decode(self, ids: torch.Tensor) -> torch.Tensor:
        if self._pos < 0:
            raise RuntimeError("decode() before prefill(): call reset() then prefill(prompt) first")
        b = ids.shape[0]
        pos = torch.tensor([self._pos], device=self.device)
        owner = self._step % self.cp_size == self.cp_rank
        if owner and self._len >= self.capacity:
            raise RuntimeError(f"KV cache full ({self.capacity} tokens per rank); more new tokens than built for")
        x = self.module.emb[ids.to(self.device)][:, None]
        for i, layer in enumerate(self.module.layers):
            q, k, v = self._qkv(layer, x, pos)
            if owner:
                self._k[i][:b, self._len] = k[:, 0]
                self._v[i][:b, self._len] = v[:, 0]
            end = self._len + int(owner)
            attn = decode_attention(q, self._k[i][:b, :end], self._v[i][:b, :end], self.groups.cp)
            x = self._finish_layer(layer, x, attn)
        self._len += int(owner)
        self._pos += 1
        self._step += 1
        return self._next_ids(x[:, -1])


def build_runner(model: dict[str, Any], groups: ParallelGroups, *, dtype: torch.dtype, device: torch.device,
                 seed: int, batch: int, prompt_len: int, new_tokens: int) -> ToyRunner:
    """:class:`RunnerFactory` of the toy GPT."""
    cfg = ToyModelConfig.parse(model, where="toy model config (megatron_ring.model.config)")
    return ToyRunner(cfg, groups, dtype=dtype, device=device, seed=seed, batch=batch,
                     prompt_len=prompt_len, new_tokens=new_tokens)
