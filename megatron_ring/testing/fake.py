"""The ``fake`` torch.distributed backend: any world size in one process, for topology tests.

It moves no data: use it to check which groups exist and who is whose neighbour, never numbers.
"""
from __future__ import annotations

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore


def init_fake_world(world_size: int, rank: int = 0) -> None:
    """Initialise torch.distributed with the fake backend as ``rank`` of ``world_size``."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
