"""The negative log-likelihood of a sequence under ring attention: :func:`ring_nll` (perplexity).

Every rank of the CP group runs the decoder on its zigzag shard and the output head on its own
positions only, in chunks, so no rank holds the logits of the whole sequence (``[seq, vocab]`` fp32
is 0.8 GB for 4k tokens of a 49k vocabulary); the per-rank sums meet in one all-reduce.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from transformers import PreTrainedModel

from megatron_ring.integrations.hf.attention import check_model
from megatron_ring.integrations.hf.context import cp_context
from megatron_ring.integrations.hf.inputs import check_ids, local_columns, local_inputs
from megatron_ring.integrations.hf.peer_errors import telling_peers


@torch.no_grad()
def ring_nll(model: PreTrainedModel, input_ids: torch.Tensor, *, group: dist.ProcessGroup | None = None,
             chunk: int = 512) -> tuple[float, int]:
    """``(sum of -log p(token i+1 | tokens <= i), number of predicted tokens)`` of ``input_ids`` ``[batch, seq]``.

    Call on every rank of ``group`` with the same global ids (no padding; any length: it is
    left-padded to a multiple of ``2 * cp`` and the padding predicts nothing). The sum is
    accumulated in float64 and is the same on every rank; perplexity is ``exp(sum / count)``.
    Models whose head does more than the output embedding (``final_logit_softcapping``) are refused.
    """
    check_model(model)
    config = model.config.get_text_config()
    if getattr(config, "final_logit_softcapping", None) is not None:
        raise ValueError(f"config.final_logit_softcapping={config.final_logit_softcapping} is not supported by "
                         "ring_nll (it applies the output embedding only); allowed: None")
    ids, mask = check_ids(input_ids, None)
    seq = ids.shape[1]
    positions = torch.arange(seq, device=ids.device).expand_as(ids)
    with cp_context(group) as ctx:
        local, pad = local_inputs(model, ctx, ids, mask, positions)
        with telling_peers(ctx, model):
            hidden = model.get_decoder()(**local, use_cache=False).last_hidden_state  # [batch, seq_local, hidden]
        columns = local_columns(ctx, seq + pad, ids.device) - pad  # global index of each local position
        valid = (columns >= 0) & (columns < seq - 1)
        targets = ids[:, (columns + 1).clamp(0, seq - 1)]
        head = model.get_output_embeddings()
        total = torch.zeros((), dtype=torch.float64)
        for start in range(0, hidden.shape[1], chunk):
            part = slice(start, start + chunk)
            logp = torch.log_softmax(head(hidden[:, part]).float(), dim=-1)
            picked = logp.gather(-1, targets[:, part, None])[..., 0]
            total -= picked[:, valid[part]].double().sum()
        if ctx.size > 1:
            dist.all_reduce(total, group=ctx.group)
    return float(total), ids.shape[0] * (seq - 1)
