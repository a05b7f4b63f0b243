"""Megatron's ``parallel_state``: the one initialisation (inference, training, tests) and our view of it."""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_ring.config.gpt import GPTConfig
from megatron_ring.config.strict import ConfigError
from megatron_ring.integrations.megatron.on_cpu import enable_megatron_on_cpu
from megatron_ring.parallel.groups import ParallelGroups, destroy_groups
from megatron_ring.parallel.layout import ParallelLayout

_OWN_GROUPS: list[dist.ProcessGroup] = []
"""Process groups the last :func:`ensure_parallel_state` made Megatron create (freed on re-init)."""
_own_minutes: Optional[int] = None
"""The group timeout (minutes) of the last initialisation :func:`ensure_parallel_state` made; None: none."""


def init_megatron(layout: ParallelLayout, *, device: torch.device = torch.device("cpu"), seed: int = 1234,
                  timeout_s: Optional[float] = None, virtual_pipeline: Optional[int] = None) -> ParallelGroups:
    """Megatron's ``parallel_state`` for ``layout`` on the running process group; returns its groups.

    The one initialisation behind inference, training, the config check and the tests. On CPU it
    first applies :func:`~megatron_ring.integrations.megatron.on_cpu.enable_megatron_on_cpu` (which refuses
    a megatron-core outside the checked range, Note [Megatron-core on CPU]); it seeds
    torch (and Megatron's CUDA RNG tracker on a GPU) with ``seed``. ``timeout_s`` bounds every
    collective of the groups Megatron creates (rounded up to whole minutes, Megatron's unit; default
    Megatron's 30 minutes); ``virtual_pipeline``: model chunks per pipeline stage (interleaved 1F1B).
    ``torch.distributed`` must already run with ``layout.world_size`` ranks.
    """
    layout.check_world_size(dist.get_world_size())
    if device.type == "cpu":
        enable_megatron_on_cpu()
    ensure_parallel_state(layout, timeout_s=timeout_s, virtual_pipeline=virtual_pipeline)
    torch.manual_seed(seed)
    if device.type == "cuda":
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return parallel_from_megatron()


def ensure_parallel_state(layout: ParallelLayout, *, timeout_s: Optional[float] = None,
                          virtual_pipeline: Optional[int] = None) -> None:
    """Initialise Megatron's ``parallel_state`` for ``layout`` unless it already has exactly these
    sizes (and, when this function made it, the same timeout).

    Megatron's ``destroy_model_parallel`` only drops its references: the groups, with their gloo
    threads and sockets, live on. When switching layouts we therefore destroy the groups our
    previous initialisation created, so a long-lived process (a test worker serving many layouts)
    does not accumulate hundreds of them.
    """
    global _own_minutes
    ps = parallel_state
    minutes = 30 if timeout_s is None else max(1, math.ceil(timeout_s / 60))
    hierarchical = None if layout.cp_a2a is None else [layout.cp_a2a, layout.cp // layout.cp_a2a]
    if ps.model_parallel_is_initialized() and _own_minutes in (None, minutes) and (
            ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
            ps.get_context_parallel_world_size(), ps.get_data_parallel_world_size(), _hierarchical_sizes(),
            ps.get_virtual_pipeline_model_parallel_world_size()
    ) == (layout.tp, layout.pp, layout.cp, layout.dp, hierarchical, virtual_pipeline):
        return
    forget_parallel_state()
    own = {id(group) for group in _OWN_GROUPS}
    _OWN_GROUPS.clear()
    destroy_groups(lambda group: id(group) in own)  # the caller may have destroyed some already
    existing = set(dist.distributed_c10d._world.pg_map)
    ps.initialize_model_parallel(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
                                 context_parallel_size=layout.cp, distributed_timeout_minutes=minutes,
                                 virtual_pipeline_model_parallel_size=virtual_pipeline,
                                 hierarchical_context_parallel_sizes=hierarchical,
                                 create_gloo_process_groups=False)
    _OWN_GROUPS.extend(g for g in dist.distributed_c10d._world.pg_map if g not in existing)
    _own_minutes = minutes


def forget_parallel_state() -> None:
    """Megatron's ``destroy_model_parallel``, and ``None`` for the module globals holding groups that it
    forgets (``_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS`` in 0.16); the groups themselves live on until
    :func:`~megatron_ring.parallel.groups.destroy_groups`."""
    parallel_state.destroy_model_parallel()
    for name, value in vars(parallel_state).items():
        if _holds_groups(value):
            setattr(parallel_state, name, None)


def _holds_groups(value: Any) -> bool:
    """A process group, or a list or tuple with one (Megatron's ``_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS``)."""
    if isinstance(value, (list, tuple)):
        return any(isinstance(item, dist.ProcessGroup) for item in value)
    return isinstance(value, dist.ProcessGroup)


def hierarchical_cp_groups() -> Optional[list[dist.ProcessGroup]]:
    """Megatron's hierarchical CP groups (``[a2a, ring]``), None when it has none. ``destroy_model_parallel``
    does not reset them, so groups destroyed since (a re-initialisation without them) count as none."""
    groups = parallel_state.get_hierarchical_context_parallel_groups(check_initialized=False)
    alive = dist.distributed_c10d._world.pg_map
    return list(groups) if groups and all(g in alive for g in groups) else None


def _hierarchical_sizes() -> Optional[list[int]]:
    groups = hierarchical_cp_groups()
    return None if groups is None else [g.size() for g in groups]


def check_parallel_state(cfg: GPTConfig) -> None:
    """ConfigError unless Megatron's parallel_state was initialised with ``cfg``'s tp/pp/cp."""
    ps = parallel_state
    if not ps.model_parallel_is_initialized():
        raise RuntimeError("megatron.core.parallel_state is not initialized; call initialize_model_parallel first")
    cfg.check_world_size(dist.get_world_size())
    actual = {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
              "cp": ps.get_context_parallel_world_size()}
    for axis, size in actual.items():
        if getattr(cfg.parallel, axis) != size:
            raise ConfigError(
                f"parallel.{axis} = {getattr(cfg.parallel, axis)} in config {cfg.name!r} but Megatron's "
                f"parallel_state was initialised with {axis} = {size}"
            )


def parallel_from_megatron() -> ParallelGroups:
    """This rank's Megatron ``parallel_state`` groups as a :class:`ParallelGroups` (tp, cp, dp, pp, dp-cp, tp-cp)."""
    ps = parallel_state
    if not ps.model_parallel_is_initialized():
        raise RuntimeError("megatron.core.parallel_state is not initialized; call initialize_model_parallel first")
    groups = {
        "tp": ps.get_tensor_model_parallel_group(),
        "pp": ps.get_pipeline_model_parallel_group(),
        "cp": ps.get_context_parallel_group(),
        "dp": ps.get_data_parallel_group(),
        "dp-cp": ps.get_data_parallel_group(with_context_parallel=True),
        "tp-cp": ps.get_tensor_and_context_parallel_group(),
    }
    hierarchical = hierarchical_cp_groups()
    if hierarchical and len(hierarchical) == 2:
        groups["cp-a2a"], groups["cp-ring"] = hierarchical
    ranks = {axis: dist.get_process_group_ranks(group) for axis, group in groups.items()}
    layout = ParallelLayout(tp=len(ranks["tp"]), pp=len(ranks["pp"]), cp=len(ranks["cp"]), dp=len(ranks["dp"]),
                            cp_a2a=len(ranks["cp-a2a"]) if "cp-a2a" in ranks else None)
    return ParallelGroups(layout=layout, rank=dist.get_rank(), groups=groups, ranks=ranks)


def process_group_collection(groups: ParallelGroups) -> Any:
    """Megatron-core's ``ProcessGroupCollection`` for ``groups`` (tp, pp, cp, dp, dp_cp, tp_cp, mp).

    For Megatron's own DDP / distributed optimizer path (``DistributedDataParallel(...,
    pg_collection=...)``), which reduces gradients over ``dp_cp`` as DeepSpeed's engine does (Note [Gradients of weights replicated over
    context-parallel ranks] in :mod:`megatron_ring.integrations.deepspeed.mpu`). ``mp`` is tp (pp = 1 in our training) unless the groups carry a ``tp-pp`` group.
    """
    g = groups.groups
    mp = g.get("tp-pp", g["tp"] if groups.layout.pp == 1 else None)
    if mp is None:
        raise ValueError("pp > 1 needs a 'tp-pp' group in ParallelGroups.groups for ProcessGroupCollection.mp")
    return ProcessGroupCollection(tp=g["tp"], pp=g["pp"], cp=g["cp"], dp=g["dp"], dp_cp=g["dp-cp"],
                                  tp_cp=g["tp-cp"], mp=mp)
