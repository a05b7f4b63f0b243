"""Workers of test_pool_hygiene.py: a test that leaks process groups, and one that cleans up after itself."""
from __future__ import annotations

import torch
import torch.distributed as dist

HELD: list[dist.ProcessGroup] = []
"""Groups a leaking test keeps, as a cache in a library might."""


def use_groups(count: int, keep: bool) -> int:
    """Create ``count`` groups of the whole world and run a collective on each; ``keep``: hold them in a
    module global (a leak: :func:`~megatron_ring.testing.hygiene.reset` cannot free them)."""
    for _ in range(count):
        group = dist.new_group(list(range(dist.get_world_size())))
        dist.all_reduce(torch.ones(1), group=group)
        if keep:
            HELD.append(group)
    return len(dist.distributed_c10d._world.pg_map)


def replace_linear() -> bool:
    """Replace ``torch.nn.functional.linear``, as DeepSpeed's ``zero.Init`` does for good."""
    torch.nn.functional.linear = lambda *args, **kwargs: None
    return True


def linear_is_torchs() -> bool:
    return torch.nn.functional.linear is torch._C._nn.linear
