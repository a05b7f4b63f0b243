"""Conversations of the Megatron runner (``megatron-ring serve``): each keeps its own share of every layer's cache.

A conversation starts with a ring prefill of its longest prefix of a multiple of ``2 cp`` tokens (the
zigzag needs it; Megatron's runner takes no padding), and the rest of the prompt runs as a turn. A
follow-up turn runs new token ``i`` on CP rank ``i % cp`` through every PP stage, and each layer's
:class:`~megatron_ring.inference.runners.gpt.CachedCoreAttention` appends its K/V and attends by
``turn_attention`` (Note [Pass-KV or pass-Q] in attention/turn.py). Decode appends on CP rank
``position % cp`` too, so turns and decode keep the shards balanced alike. The layers' caches belong
to the conversation in hand: :meth:`MegatronConversations._use` puts its tensors into the layers,
:meth:`_keep` takes them back.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_ring.integrations.megatron.sequence_parallel import sequence_parallel_off


@dataclass
class MegatronConversation:
    """One conversation's cache on this rank: every layer's state and the tokens it has seen."""

    layers: list[Any] = field(default_factory=list)
    seen: int = 0


class MegatronConversations:
    """The conversation methods of :class:`~megatron_ring.inference.runners.gpt.MegatronRunner`."""

    caches: list[Any]
    module: Any
    sequence_parallel: bool
    cp_size: int
    cp_rank: int
    device: torch.device
    groups: Any
    _pos: int
    _step: int

    def _use(self, conv: MegatronConversation | None) -> None:
        for i, cache in enumerate(self.caches):
            if conv is None or not conv.layers:
                cache.k = cache.v = None
                cache.length, cache.k_positions = 0, torch.zeros(cache.capacity, dtype=torch.long, device=self.device)
            else:
                cache.load(conv.layers[i])
        self._pos = -1 if conv is None else conv.seen

    def _keep(self, conv: MegatronConversation) -> MegatronConversation:
        conv.layers, conv.seen = [cache.state() for cache in self.caches], self._pos
        return conv

    def start(self, documents: list[torch.Tensor]) -> list[tuple[MegatronConversation, int]]:
        """First turns, one after the other: each one's conversation and greedy next token."""
        out = []
        for doc in documents:
            self._use(None)
            doc = doc.to(self.device)
            multiple = 2 * self.cp_size  # a ring prefill's unit; with sequence parallelism also cp * tp
            if self.sequence_parallel:
                multiple = math.lcm(multiple, self.cp_size * self.groups.layout.tp)
            whole = doc.numel() - doc.numel() % multiple
            token = -1
            if whole:
                token = int(self.prefill(doc[None, :whole])[0])
            conv = MegatronConversation()
            self._pos = whole
            if whole < doc.numel():
                token = self._turn(doc[whole:], "auto")
            out.append((self._keep(conv), token))
        return out

    def extend(self, conv: MegatronConversation, ids: torch.Tensor, mode: str) -> int:
        self._use(conv)
        token = self._turn(ids.to(self.device), mode)
        self._keep(conv)
        return token

    def step(self, conv: MegatronConversation, token: int) -> int:
        self._use(conv)
        self._step = 1  # past the first step of a request: no decode handshake
        out = int(self.decode(torch.tensor([token], device=self.device))[0])
        self._keep(conv)
        return out

    def keep_first(self, conv: MegatronConversation, tokens: int) -> None:
        self._use(conv)
        for cache in self.caches:
            cache.keep_first(tokens)
        self._pos = min(self._pos, tokens)
        self._keep(conv)

    def fork(self, conv: MegatronConversation, tokens: int) -> MegatronConversation:
        """A new conversation holding a copy of ``conv``'s first ``tokens`` tokens (``conv`` unchanged)."""
        layers = []
        for k, v, positions, length, _ in conv.layers:
            if k is None:
                layers.append((None, None, positions.clone(), 0, positions.numel()))
                continue
            keep = torch.nonzero(positions[:length] < tokens)[:, 0]
            layers.append((k[keep], v[keep], positions[keep], keep.numel(), keep.numel()))
        return MegatronConversation(layers, min(conv.seen, tokens))

    def _turn(self, ids: torch.Tensor, mode: str) -> int:
        """``ids`` (1-D) at positions ``_pos ..``; each CP rank runs its own (Note in the module docstring)."""
        positions = torch.arange(self._pos, self._pos + ids.numel(), device=self.device)
        mine = positions % self.cp_size == self.cp_rank
        local_ids, local_pos = ids[mine], positions[mine]
        n = local_ids.numel()
        if n == 0:  # a model cannot run 0 tokens: one placeholder, neither attended nor kept
            local_ids, local_pos = ids[:1], positions[:1]
        for cache in self.caches:
            cache.turn, cache.decoding = (n, mode), False
        try:
            with sequence_parallel_off(self.module):  # a turn's few tokens per rank do not split over TP
                hidden = self._pipelined(local_ids[None], local_pos, 1)
        finally:
            for cache in self.caches:
                cache.turn = None
        self._pos += ids.numel()
        owner = (self._pos - 1) % self.cp_size
        return int(self._greedy(hidden, owner, 1)[0])
