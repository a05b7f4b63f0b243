"""The KV cache of a transformers model sharded over the CP group: :class:`RingCache`.

Note [Prefill, replay, decode]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``ring_generate`` runs the prompt itself (one forward over the local shard, ring attention,
global RoPE positions), then hands the filled :class:`RingCache` to ``model.generate``. The prompt's
last token lives on one rank only, so its logits cannot come from every rank. Instead the cache
forgets that one token's K/V and reports ``L - 1`` seen tokens: ``generate`` then "continues" the
prompt with its last token as an ordinary decode step, which every rank computes identically
(``decode_attention`` merges all shards). From there ``generate``'s own bookkeeping (positions
from the global mask, sampling, beams, stopping, logits processors) is exactly the single-process
one. Each decode token's K/V is kept by exactly one rank, ``global_index % cp_size`` (round-robin);
the others drop it.

The ring prefill needs a length that is a multiple of ``2 * cp``, so the prompt is left-padded by
``pad`` masked tokens; the cache drops their K/V (no real token attends them) and numbers its
columns from the first real prompt token, so ``generate`` sees the user's prompt, unpadded.

Beam search reorders (and first repeats) the batch rows of every layer on every rank:
``reorder_cache`` / ``batch_repeat_interleave`` act on the local shard's batch dimension, and the
beam indices are the same on every rank, so the union of the shards is reordered exactly as
``Cache.reorder_cache`` reorders a whole cache.

Note [Decode handshake once]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``decode_attention`` checks by default, with one small all-gather, that every rank passed the same
shapes, dtype, scale, mask presence and window (Note [Cross-rank handshake]). In a decode loop every
step repeats the first step's call: one query token, the batch and the padding of the prompt, the
same layer. So each layer runs the handshake on its first decode step only; later steps skip it,
halving the collectives of a step (a model of 30 layers made 60 all-gathers per token). After
that first step a model error on one rank is no longer sent to the others (Note [A model error on
one rank]): they wait in a data collective, where a handshake row does not fit.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator

import torch
from transformers.cache_utils import Cache, DynamicLayer


class RingCacheLayer(DynamicLayer):
    """One layer of a :class:`RingCache`: this rank's K/V ``[batch, heads_kv, n_local, head_dim]``.

    ``columns`` (int64 ``[n_local]``) are the global token indices of the local entries, in order;
    ``seen`` counts the tokens of the whole (global) sequence, on every rank.
    """

    is_croppable = False

    def __init__(self, owner: "RingCache") -> None:
        super().__init__()
        # A weak reference: a strong one would make every cache a reference cycle, freed only when Python's
        # cyclic collector happens to run (a serving rank held every evicted conversation until then).
        self.owner = weakref.proxy(owner)
        self.columns: torch.Tensor | None = None
        self.seen = 0
        self.agreed = False
        """Whether a decode step of this layer has passed the cross-rank handshake (Note [Decode handshake once])."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this rank's share of the new K/V ``[batch, heads_kv, q_len, head_dim]``; return the local shard."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        turn = self.owner.turn_plan
        if turn is not None:  # Note [Pass-KV or pass-Q] in attention/turn.py: this rank's new tokens, appended
            columns, new_tokens = turn
            n = columns.numel()  # a rank without new tokens runs one placeholder token: not kept
            self.keys = torch.cat([self.keys, key_states[..., :n, :]], dim=-2)
            self.values = torch.cat([self.values, value_states[..., :n, :]], dim=-2)
            columns = columns.to(key_states.device)
            self.columns = columns if self.columns is None else torch.cat([self.columns, columns])
            self.seen += new_tokens
            return self.keys, self.values
        plan = self.owner.prefill_plan
        if plan is not None:
            columns, padding, global_len = plan
            if self.seen:
                raise ValueError(f"RingCache already holds {self.seen} tokens; a ring prefill needs an empty cache")
            if key_states.shape[-2] != columns.numel() + padding:
                raise ValueError(f"prefill K/V have {key_states.shape[-2]} local tokens, expected "
                                 f"{columns.numel() + padding}")
            # left padding of the prefill: attended, never stored
            self.keys, self.values = key_states[..., padding:, :], value_states[..., padding:, :]
            self.columns, self.seen = columns.to(key_states.device), global_len
            return key_states, value_states
        if key_states.shape[-2] != 1:
            raise ValueError(
                f"RingCache decodes one token per step, got {key_states.shape[-2]} (assisted or chunked decoding "
                "is not supported)"
            )
        index, self.seen = self.seen, self.seen + 1
        if index % self.owner.cp_size == self.owner.cp_rank:
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
            new = torch.tensor([index], dtype=torch.long, device=key_states.device)
            self.columns = new if self.columns is None else torch.cat([self.columns, new])
        return self.keys, self.values

    def forget_last(self) -> None:
        """Drop the last global token seen, on whichever rank holds it."""
        if self.columns is not None and self.columns.numel() and int(self.columns[-1]) == self.seen - 1:
            self.keys, self.values = self.keys[..., :-1, :], self.values[..., :-1, :]
            self.columns = self.columns[:-1]
        self.seen -= 1

    def get_seq_length(self) -> int:
        return self.seen

    def keep_first(self, tokens: int) -> None:
        """Keep the conversation's first ``tokens`` tokens: drop the local entries at later columns."""
        if self.columns is not None and self.keys is not None:
            keep = self.columns < tokens
            self.keys, self.values, self.columns = self.keys[..., keep, :], self.values[..., keep, :], self.columns[keep]
        self.seen = min(self.seen, tokens)

    def _map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply ``fn`` to the batch rows of the local K/V, also when this rank's shard is empty
        (``DynamicLayer`` skips a layer whose ``get_seq_length()`` is 0, which here is the global count)."""
        if self.is_initialized:
            self.keys, self.values = fn(self.keys), fn(self.values)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_rows(lambda x: x.index_select(0, beam_idx.to(x.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_rows(lambda x: x.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_rows(lambda x: x[indices, ...])

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise ValueError("RingCache cannot be cropped (assisted decoding is not supported with ring attention)")


class RingCache(Cache):
    """A KV cache sharded over the ranks of a CP group (see Note [Prefill, replay, decode]).

    After a ring prefill each rank holds the K/V of its own zigzag shard of the prompt; every decode
    token's K/V is kept by exactly one rank (``index % cp_size``). ``get_seq_length()`` is global.
    """

    def __init__(self, num_layers: int, cp_rank: int, cp_size: int) -> None:
        super().__init__(layers=[RingCacheLayer(self) for _ in range(num_layers)])
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.prefill_plan: tuple[torch.Tensor, int, int] | None = None
        self.turn_plan: tuple[torch.Tensor, int] | None = None

    @contextlib.contextmanager
    def turn(self, columns: torch.Tensor, new_tokens: int) -> Iterator[None]:
        """Inside the block, ``update`` appends this rank's share of a new turn: the tokens at global
        ``columns`` (int64 ``[n_local]``, may be empty), of ``new_tokens`` new tokens over all ranks."""
        self.turn_plan = (columns, new_tokens)
        try:
            yield
        finally:
            self.turn_plan = None

    def keep_first(self, tokens: int) -> None:
        """Crop the conversation to its first ``tokens`` tokens on every layer."""
        for layer in self.layers:
            layer.keep_first(tokens)

    def prefix_copy(self, tokens: int) -> "RingCache":
        """A new cache holding a copy of this rank's entries of the first ``tokens`` tokens (this one unchanged)."""
        copy = RingCache(len(self.layers), self.cp_rank, self.cp_size)
        for mine, theirs in zip(self.layers, copy.layers):
            if mine.keys is None or mine.columns is None:
                continue
            keep = torch.nonzero(mine.columns < tokens)[:, 0]
            theirs.lazy_initialization(mine.keys, mine.values)
            theirs.keys, theirs.values = mine.keys[..., keep, :], mine.values[..., keep, :]
            theirs.columns, theirs.seen = mine.columns[keep], min(mine.seen, tokens)
        return copy

    def nbytes(self) -> int:
        """Bytes of this rank's K/V, all layers."""
        return sum(2 * layer.keys.numel() * layer.keys.element_size() for layer in self.layers
                   if layer.keys is not None)

    @contextlib.contextmanager
    def prefill(self, columns: torch.Tensor, global_len: int) -> Iterator[None]:
        """Inside the block, ``update`` stores the local shard: ``columns`` are its global indices, negative
        ones (left padding of the prefill) are dropped; the sequence then counts ``global_len`` tokens.

        The local indices increase (zigzag: chunk r, then chunk 2 cp - 1 - r), so the padding is a
        prefix of the shard, counted here, outside the model's forward: ``update`` then drops it with a
        slice, no data-dependent shape (a graph break under torch.compile)."""
        padding = int((columns < 0).sum())
        if not bool((columns[padding:] >= 0).all()):
            raise ValueError("prefill columns must list the left padding (negative columns) first")
        self.prefill_plan = (columns[padding:], padding, global_len)
        try:
            yield
        finally:
            self.prefill_plan = None

    def forget_last(self) -> None:
        """Forget the last token in every layer (the replay step of ``ring_generate`` re-adds it)."""
        for layer in self.layers:
            layer.forget_last()

    def start_decode(self) -> None:
        """Make every shard contiguous (as decode's appends leave it), give each layer its own
        ``columns`` and mark the lengths dynamic: a compiled decode step then compiles twice (a step
        that keeps the new token on this rank, one that does not) and never again as the shards grow."""
        for layer in self.layers:
            if layer.keys is None or layer.columns is None:
                continue
            layer.keys, layer.values = layer.keys.contiguous(), layer.values.contiguous()
            layer.columns = layer.columns.clone()  # prefill shares one tensor between layers
            for tensor, dim in ((layer.keys, 2), (layer.values, 2), (layer.columns, 0)):
                torch._dynamo.maybe_mark_dynamic(tensor, dim)
