"""transformers probe cases, run on every rank of a gloo pool: each returns what the rank saw."""
from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from megatron_ring import shard_sequence
from megatron_ring.hf import cp_context, ring_forward
from megatron_ring.testing.tiny_hf import sample_prompts, tiny_model

Outcome = tuple[str, str]
"""(exception class name or "ok", message)."""


def _outcome(fn: Any) -> tuple[Outcome, Any]:
    try:
        return ("ok", ""), fn()
    except Exception as err:  # the case inspects it
        return (type(err).__name__, "\n".join([str(err), *getattr(err, "__notes__", [])])), None


def generate_in_bare_context(new_tokens: int) -> Outcome:
    """``model.generate`` called directly inside ``cp_context`` (the prompt sharded as cp_context asks)."""
    model = tiny_model("llama", attn_implementation="ring")
    ids = sample_prompts()["plain"][0]
    rank, size = dist.get_rank(), dist.get_world_size()
    with torch.no_grad(), cp_context():
        return _outcome(lambda: model.generate(shard_sequence(ids, rank, size, dim=1), max_new_tokens=new_tokens))[0]


def forward_in_bare_context(inputs: str) -> tuple[Outcome, float | None]:
    """One forward inside ``cp_context``: ``"global"`` (the global ids as if they were the shard, no
    positions), ``"no positions"`` (the shard without its global positions) or ``"shard"`` (shard and
    global positions, as documented); with the relative error of the last case's logits against
    ``ring_forward``'s shard of the same prompt."""
    model = tiny_model("llama", attn_implementation="ring")
    ids = sample_prompts()["plain"][0]
    rank, size = dist.get_rank(), dist.get_world_size()
    local = shard_sequence(ids, rank, size, dim=1)
    positions = shard_sequence(torch.arange(ids.shape[1]).expand_as(ids), rank, size, dim=1)
    kwargs = {"global": {"input_ids": ids}, "no positions": {"input_ids": local},
              "shard": {"input_ids": local, "position_ids": positions}}[inputs]
    with torch.no_grad(), cp_context():
        outcome, out = _outcome(lambda: model(**kwargs, use_cache=False).logits)
    if out is None:
        return outcome, None
    want = ring_forward(model, ids, gather_logits=False)
    return outcome, float((out - want).norm() / want.norm())


def gpt2_past_its_positions(n_positions: int, prompt: int) -> tuple[Outcome, float]:
    """``ring_forward`` of a tiny GPT-2 over a prompt longer than its learned position table: the
    rank whose shard holds the late positions fails in the embedding, before any attention call."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_positions=n_positions, n_embd=32, n_layer=2, n_head=2, vocab_size=64)
    model = GPT2LMHeadModel(config).eval()
    model.set_attn_implementation("ring")
    ids = torch.randint(0, 64, (1, prompt), generator=torch.Generator().manual_seed(1))
    start = time.monotonic()
    outcome, _ = _outcome(lambda: ring_forward(model, ids))
    return outcome, time.monotonic() - start


def decode_handshakes(new_tokens: int) -> list[list[bool]]:
    """``check_consistency`` of every ``decode_attention`` call of a ``ring_generate``, per layer in order."""
    from megatron_ring.hf import ring_generate
    from megatron_ring.integrations.hf import attention

    model = tiny_model("llama", attn_implementation="ring")
    calls: list[bool] = []
    real = attention.decode_attention

    def recording(*args: Any, check_consistency: bool = True, **kwargs: Any) -> torch.Tensor:
        calls.append(check_consistency)
        return real(*args, check_consistency=check_consistency, **kwargs)

    attention.decode_attention = recording
    try:
        ring_generate(model, sample_prompts()["padded"][0], sample_prompts()["padded"][1], max_new_tokens=new_tokens)
    finally:
        attention.decode_attention = real
    layers = model.config.num_hidden_layers
    return [calls[i:i + layers] for i in range(0, len(calls), layers)]
