"""A model error on one CP rank reaches the other ranks at once, not after the collective timeout.

Note [A model error on one rank]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The ranks of a CP group run the same model code on different shards, so an error can hit one rank
only: GPT-2's learned position embedding raises IndexError on the rank whose shard holds the
positions past ``n_positions`` (zigzag puts the last tokens on CP rank 0). Its peers then waited in
their next attention call's handshake until the collective timeout, and gloo aborted them. Every
attention call of this adapter starts with that handshake (Note [Cross-rank handshake] in
attention/handshake.py), so the failing rank joins it as a rejected rank (``tell_peers``): the
peers raise a ValueError naming it and quoting its error at once, and it raises its own error,
with a note saying that the others were told.

Which call the peers wait in: the failing rank counts the attention calls it has completed
(``CPContext.attention_calls``). Before the first attention call of a forward, or between two,
its peers are in the handshake of the next one, and the message goes there. After the last
attention layer of a forward (the final norm, the head, the gather of the logits, ``generate``'s
sampling) a peer may be in a collective that is not a handshake, or in none, so nothing is sent:
such an error still leaves the peers to the collective timeout. An error inside an attention call
is the core's: its own checks tell the peers (``prepare`` in attention/call.py), and a failed
collective fails on every rank.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from transformers import PreTrainedModel

from megatron_ring.attention.handshake import tell_peers
from megatron_ring.integrations.hf.context import CPContext


def _peers_wait_in_a_handshake(ctx: CPContext, layers: int) -> bool:
    """Whether the other ranks now wait in the handshake of this rank's next attention call (decode
    steps after the first have none: Note [Decode handshake once] in cache.py)."""
    if ctx.size == 1 or ctx.compiled or ctx.in_attention or (ctx.attention_calls and ctx.attention_calls % layers == 0):
        return False
    return ctx.phase != "decode" or ctx.cache is None or not ctx.cache.layers[ctx.attention_calls % layers].agreed


@contextlib.contextmanager
def telling_peers(ctx: CPContext, model: PreTrainedModel) -> Iterator[None]:
    """Run model calls in ``ctx``; an error of this rank alone is sent to the others where they can
    take it (Note [A model error on one rank]), then raised here."""
    layers = model.config.get_text_config().num_hidden_layers
    try:
        yield
    except Exception as err:
        if _peers_wait_in_a_handshake(ctx, layers):
            entry = "decode_attention" if ctx.phase == "decode" else "ring_attention"
            try:
                tell_peers(entry, ctx.group, ctx.size, err)
                err.add_note(f"raised on CP rank {ctx.rank} of {ctx.size}, in the model outside attention; the other "
                             "ranks of the CP group were told and raise a ValueError naming this rank")
            except Exception as lost:  # the peers are gone or elsewhere: this rank's error is the one to see
                err.add_note(f"raised on CP rank {ctx.rank} of {ctx.size}; telling the other ranks failed: {lost}")
        raise
