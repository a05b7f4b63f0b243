"""A long-lived pool worker kept clean between tests: what a test created is torn down, what is left is measured.

Run on every rank of a :class:`~megatron_ring.testing.gloo.GlooPool`:

* :func:`snapshot` once at the worker's start (the pool's ``setup``): remembers ``torch.nn.functional``;
* :func:`reset` after a test module: destroys every process group but the world, drops the caches
  that hold groups (ours, Megatron's ``parallel_state``, DeepSpeed's ``groups``), puts back the
  functions a test replaced in ``torch.nn.functional`` (DeepSpeed's ``zero.Init`` replaces ``linear``),
  and returns :func:`probe`'s numbers;
* :func:`probe`: the threads, process groups and resident memory of this rank.

Note [What a gloo group leaves behind]: each gloo process group owns a TCP device loop
(``gloo_tcp_loop``) and two work threads (``pt_gloo_runloop``), which end only when the last Python
reference to the group is gone. ``destroy_process_group`` drops torch's own reference; a cache that
still holds the group (a layout's groups, Megatron's or DeepSpeed's module globals, an ``lru_cache``
keeping a model and its DDP buffers) keeps the threads alive. A worker that served a few hundred
tests this way held 500 threads and slowed every rank of the machine, so after a reset the probe
must find the threads of a fresh worker again.
"""
from __future__ import annotations

import gc
import os
import sys
import threading
from typing import Any

import torch
import torch.distributed as dist

_FUNCTIONAL: dict[str, Any] = {}
"""``torch.nn.functional``'s public attributes as the worker started."""


def snapshot() -> None:
    """Remember ``torch.nn.functional`` as it is now (call once, when the worker starts)."""
    functional = torch.nn.functional
    _FUNCTIONAL.update({name: value for name, value in vars(functional).items() if not name.startswith("_")})


def probe() -> dict[str, float]:
    """This rank's ``{"threads", "groups", "rss_mb"}``: threads of the process, live process groups
    (the world included) and resident memory."""
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else threading.active_count()
    groups = len(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else 0
    return {"threads": threads, "groups": groups, "rss_mb": round(_rss_bytes() / 2**20, 1)}


def reset() -> dict[str, float]:
    """Tear down what tests left in this worker (see the module's docstring) and return :func:`probe`."""
    _forget_framework_groups()
    _forget_own_groups()
    if dist.is_initialized():
        world = dist.GroupMember.WORLD
        for group in [g for g in dist.distributed_c10d._world.pg_map if g is not world]:
            dist.destroy_process_group(group)
    functional = torch.nn.functional
    for name, value in _FUNCTIONAL.items():
        if getattr(functional, name, None) is not value:
            setattr(functional, name, value)
    gc.collect()
    return probe()


def _forget_own_groups() -> None:
    from megatron_ring.parallel import groups

    groups._CREATED.clear()
    state = sys.modules.get("megatron_ring.integrations.megatron.state")
    if state is not None:
        state._OWN_GROUPS.clear()
        state._own_minutes = None


def _forget_framework_groups() -> None:
    """Megatron's and DeepSpeed's module globals that hold process groups, where those are loaded."""
    if "megatron.core.parallel_state" in sys.modules:
        sys.modules["megatron.core.parallel_state"].destroy_model_parallel()
    rotary = sys.modules.get("megatron.core.models.common.embeddings.rotary_pos_embedding")
    if rotary is not None:  # an lru_cache keyed on the module keeps the last 32 models alive
        rotary.RotaryEmbedding.forward.cache_clear()
    ds_groups = sys.modules.get("deepspeed.utils.groups")
    if ds_groups is not None:
        ds_groups.mpu = None
        for name, value in vars(ds_groups).items():
            if name.startswith("_") and name.endswith(("_GROUP", "_GROUP_RANKS")):
                setattr(ds_groups, name, {} if isinstance(value, dict) else None)


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0
