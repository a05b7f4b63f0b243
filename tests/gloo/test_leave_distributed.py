"""``leave_distributed``: every rank waits for the others, the cached layout groups are forgotten and
every gloo thread has ended before the function returns (Note [Leaving torch.distributed])."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_ring.runtime.pool import run_gloo



def _gloo_threads() -> int:
    names = (task / "comm" for task in Path("/proc/self/task").iterdir())
    return sum(1 for name in names if name.exists() and name.read_text().startswith(("gloo", "pt_gloo")))


def _use_groups_then_leave() -> dict[str, int]:
    from megatron_ring.parallel import groups as groups_module
    from megatron_ring.parallel.groups import leave_distributed
    from megatron_ring.parallel.layout import ParallelLayout

    size = dist.get_world_size()
    cp = groups_module.init_parallel(ParallelLayout(cp=size)).groups["cp"]
    total = torch.ones(1)
    dist.all_reduce(total, group=cp)
    del cp  # the caller's own references are its business; the cache is ours
    before = _gloo_threads()
    leave_distributed()
    return {"sum": int(total.item()), "before": before, "after": _gloo_threads(),
            "cached": len(groups_module._CREATED), "initialized": int(dist.is_initialized())}


@pytest.mark.parametrize("world_size", [2, 3])
def test_leaving_ends_every_group_and_its_threads(world_size: int) -> None:
    for rank, result in enumerate(run_gloo(_use_groups_then_leave, world_size, timeout_s=60)):
        assert result["sum"] == world_size, rank
        assert result["before"] > 3, f"rank {rank}: the cp group's gloo threads were never started: {result}"
        assert result == {**result, "after": 0, "cached": 0, "initialized": 0}, f"rank {rank}: {result}"
