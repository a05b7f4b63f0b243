"""Workers for tests/gloo/test_wire_dtype.py: what each rank puts on the wire, by dtype."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_ring import ring_attention, shard_sequence


def bytes_on_the_wire(comm: str, dtype: torch.dtype, window: tuple[int, int] = (-1, -1)) -> dict[str, object]:
    """Bytes of the tensors this rank hands to point-to-point sends and reductions in one ring call,
    forward and backward, with the dtypes they travel in; K/V ``[1, 8 * P, 2, 4]`` local shards."""
    rank, size = dist.get_rank(), dist.get_world_size()
    sent = {"bytes": 0, "dtypes": set()}
    saved_batch, saved_reduce = dist.batch_isend_irecv, dist.reduce

    def batch(ops):
        for op in ops:
            if op.op is dist.isend:
                sent["bytes"] += op.tensor.numel() * op.tensor.element_size()
                sent["dtypes"].add(str(op.tensor.dtype))
        return saved_batch(ops)

    def reduce(tensor, *args, **kwargs):
        sent["bytes"] += tensor.numel() * tensor.element_size()
        sent["dtypes"].add(str(tensor.dtype))
        return saved_reduce(tensor, *args, **kwargs)

    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(1, 16 * size, h, 4, dtype=dtype) for h in (4, 2, 2, 4))
    ql, kl, vl = (shard_sequence(t, rank, size).requires_grad_() for t in (q, k, v))
    dist.batch_isend_irecv, dist.reduce = batch, reduce
    try:
        out = ring_attention(ql, kl, vl, causal=True, comm=comm, window_size=window, check_consistency=False)
        forward = {"bytes": sent["bytes"], "dtypes": sorted(sent["dtypes"])}
        sent.update(bytes=0, dtypes=set())
        out.backward(shard_sequence(dout, rank, size))
        backward = {"bytes": sent["bytes"], "dtypes": sorted(sent["dtypes"])}
    finally:
        dist.batch_isend_irecv, dist.reduce = saved_batch, saved_reduce
    return {"forward": forward, "backward": backward, "kv_block_bytes": 2 * kl.numel() * kl.element_size()}
