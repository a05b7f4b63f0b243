"""What a causal LM thinks of each token of a sequence under ring attention: :func:`ring_token_scores`
(lm-eval log-likelihoods, loss by position) and its sum :func:`ring_nll` (perplexity).

Every rank of the CP group runs the decoder on its zigzag shard and the output head on its own
positions only, in chunks, so no rank holds the logits of the whole sequence (``[seq, vocab]`` fp32
is 0.8 GB for 4k tokens of a 49k vocabulary); only two numbers per position travel (one all-gather).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from megatron_ring.integrations.hf.attention import check_model
from megatron_ring.integrations.hf.context import cp_context
from megatron_ring.integrations.hf.inputs import check_ids, gather_seq, generate_positions, local_columns, local_inputs
from megatron_ring.integrations.hf.peer_errors import telling_peers


@dataclass(frozen=True)
class TokenScores:
    """What the model predicts at each position of ``[batch, seq]`` ids: position ``i`` predicts token ``i + 1``.

    ``logprob``: float32 ``[batch, seq - 1]``, ``log p(token i+1 | tokens <= i)`` (0 where token ``i + 1``
    or token ``i`` is left padding); ``argmax``: int64 ``[batch, seq]``, the greedy token after position
    ``i`` (ties to the lower id; the last column is the next token after the row; -1 on padding).
    The same on every rank.
    """

    logprob: torch.Tensor
    argmax: torch.Tensor


@torch.no_grad()
def ring_token_scores(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                      *, group: dist.ProcessGroup | None = None, chunk: int = 512) -> TokenScores:
    """:class:`TokenScores` of ``input_ids`` ``[batch, seq]`` (int64; ``attention_mask`` ``[batch, seq]``: 0 on
    *left* padding, None: none), the same global tensors on every rank of ``group``.

    Rows may differ in length (left-padded): positions restart at each row's first real token, as in
    ``generate``, and a rank whose share of a row is all padding computes nothing that counts.
    Models whose head does more than the output embedding (``final_logit_softcapping``) are refused.
    """
    check_model(model)
    config = model.config.get_text_config()
    if getattr(config, "final_logit_softcapping", None) is not None:
        raise ValueError(f"config.final_logit_softcapping={config.final_logit_softcapping} is not supported by "
                         "ring_token_scores (it applies the output embedding only); allowed: None")
    ids, mask = check_ids(input_ids, attention_mask)
    seq = ids.shape[1]
    with cp_context(group) as ctx:
        local, pad = local_inputs(model, ctx, ids, mask, generate_positions(mask))
        with telling_peers(ctx, model):
            hidden = model.get_decoder()(**local, use_cache=False).last_hidden_state  # [batch, seq_local, hidden]
        columns = local_columns(ctx, seq + pad, ids.device) - pad  # global index of each local position
        targets = ids[:, (columns + 1).clamp(0, seq - 1)]  # [batch, seq_local]
        head = model.get_output_embeddings()
        logprob = torch.zeros(targets.shape, dtype=torch.float32, device=ids.device)
        argmax = torch.zeros(targets.shape, dtype=torch.float32, device=ids.device)  # ids < 2**24: exact in fp32
        for start in range(0, hidden.shape[1], chunk):
            part = slice(start, start + chunk)
            logits = head(hidden[:, part]).float()  # [batch, chunk, vocab]
            logprob[:, part] = torch.log_softmax(logits, dim=-1).gather(-1, targets[:, part, None])[..., 0]
            argmax[:, part] = logits.argmax(dim=-1).float()
        both = gather_seq(ctx, torch.stack([logprob, argmax], dim=-1))[:, pad:]  # [batch, seq, 2]
    valid = (mask[:, :-1] * mask[:, 1:]).bool()
    return TokenScores(both[:, :-1, 0].masked_fill(~valid, 0.0), both[..., 1].long().masked_fill(mask == 0, -1))


def ring_nll(model: PreTrainedModel, input_ids: torch.Tensor, *, group: dist.ProcessGroup | None = None,
             chunk: int = 512) -> tuple[float, int]:
    """``(sum of -log p(token i+1 | tokens <= i), number of predicted tokens)`` of ``input_ids`` ``[batch, seq]``
    (no padding; any length), summed in float64: the same on every rank; perplexity is ``exp(sum / count)``."""
    scores = ring_token_scores(model, input_ids, group=group, chunk=chunk)
    return -float(scores.logprob.double().sum()), input_ids.shape[0] * (input_ids.shape[1] - 1)
