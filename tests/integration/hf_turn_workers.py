"""Conversations through ring_prefill_documents / ring_extend / ring_decode_step on every rank of a gloo pool.

A conversation is a first document, then turns: ``(new token ids, tokens to answer)``; every answer is
greedy. The test recomputes each answer in one process from the whole history (transformers ``generate``).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_ring.hf import ring_decode_step, ring_extend, ring_prefill_documents
from megatron_ring.testing.tiny_hf import tiny_model


def conversation(seed: int = 3) -> tuple[torch.Tensor, list[tuple[torch.Tensor, int]]]:
    """A 37-token document answered with 5 tokens, then turns of 9 and of 1 token (4 and 3 answered)."""
    gen = torch.Generator().manual_seed(seed)
    document = torch.randint(0, 256, (37,), generator=gen)
    return document, [(torch.tensor([], dtype=torch.long), 5), (torch.randint(0, 256, (9,), generator=gen), 4),
                      (torch.randint(0, 256, (1,), generator=gen), 3)]


def _answer(model: Any, cache: Any, logits: torch.Tensor, count: int) -> list[int]:
    tokens = [int(logits.argmax())]
    while len(tokens) < count:
        tokens.append(int(ring_decode_step(model, cache, tokens[-1]).argmax()))
    return tokens


def run_conversation(family: str, mode: str, overrides: dict[str, Any]) -> list[list[int]]:
    """Every answer of :func:`conversation` (the answer's last token is fed back before the next turn)."""
    model = tiny_model(family, attn_implementation="ring", **overrides)
    document, turns = conversation()
    [(cache, logits)] = ring_prefill_documents(model, [document])
    answers = []
    for i, (ids, count) in enumerate(turns):
        if i:
            logits = ring_extend(model, cache, torch.cat([torch.tensor([answers[-1][-1]]), ids]), mode=mode)
        answers.append(_answer(model, cache, logits, count))
    assert cache.get_seq_length() == len(document) + sum(len(ids) + n for ids, n in turns) - 1
    return answers


def run_ragged(lengths: list[int], count: int) -> dict[str, Any]:
    """Documents of ``lengths`` in one packed prefill, each answered alone; this rank's cache sizes."""
    model = tiny_model("llama", attn_implementation="ring")
    gen = torch.Generator().manual_seed(11)
    docs = [torch.randint(0, 256, (n,), generator=gen) for n in lengths]
    started = ring_prefill_documents(model, docs)
    answers = [_answer(model, cache, logits, count) for cache, logits in started]
    sizes = [int(cache.layers[0].columns.numel()) for cache, _ in started]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, sizes)
    return {"answers": answers, "first_logits": [logits for _, logits in started], "shard_sizes": every}


def run_rows(family: str, overrides: dict[str, Any], lengths: list[int], count: int) -> dict[str, Any]:
    """Documents of ``lengths`` answered together (``ring_decode_rows``) and one by one (``ring_decode_step``)."""
    from megatron_ring.hf import ring_decode_rows

    model = tiny_model(family, attn_implementation="ring", **overrides)
    gen = torch.Generator().manual_seed(13)
    docs = [torch.randint(0, 256, (n,), generator=gen) for n in lengths]
    started = ring_prefill_documents(model, docs)
    caches, tokens = [c for c, _ in started], [[int(logits.argmax())] for _, logits in started]
    for _ in range(count - 1):
        logits = ring_decode_rows(model, caches, [t[-1] for t in tokens])
        for row, t in zip(logits, tokens):
            t.append(int(row.argmax()))
    alone = [_answer(model, cache, logits, count) for cache, logits in ring_prefill_documents(model, docs)]
    return {"together": tokens, "alone": alone}
