"""CommCounter: bytes sent per rank through torch.distributed, counted once per call."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_ring.inference.metrics import CommCounter


def count_some_traffic() -> dict[str, dict[str, float]]:
    rank, size = dist.get_rank(), dist.get_world_size()
    x = torch.ones(1024)  # 4 KiB
    counter = CommCounter()
    original = dist.all_reduce
    with counter.active():
        counter.phase = "a"
        dist.all_reduce(x)
        out = torch.empty(size * 1024)
        dist.all_gather_into_tensor(out, x)  # deprecated alias forwarding to all_gather_single: once
        recv = torch.empty(1024)
        ops = [dist.P2POp(dist.isend, x, (rank + 1) % size), dist.P2POp(dist.irecv, recv, (rank - 1) % size)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        counter.phase = "b"
        dist.broadcast(x, src=0)
    assert dist.all_reduce is original, "torch.distributed not restored"
    return counter.sent


def test_counts_ring_volumes_per_phase(gloo_pool) -> None:
    for sent in gloo_pool(2).run(count_some_traffic):
        nbytes = 4096.0
        assert sent["a"]["all_reduce"] == 2 * (2 - 1) / 2 * nbytes
        gathered = sent["a"].get("all_gather_into_tensor", 0) + sent["a"].get("all_gather_single", 0)
        assert gathered == nbytes
        assert sent["a"]["isend"] == nbytes
        assert sent["b"] == {"broadcast": nbytes}
