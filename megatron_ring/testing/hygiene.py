"""A long-lived pool worker kept clean between tests: what a test created is torn down, what is left is measured.

Run on every rank of a :class:`~megatron_ring.testing.gloo.GlooPool`:

* :func:`snapshot` once at the worker's start (the pool's ``setup``): remembers ``torch.nn.functional``;
* :func:`reset` after a test module: destroys every process group but the world, drops the caches
  that hold groups (ours, ``torch.compile``'s, Megatron's ``parallel_state``, DeepSpeed's ``groups``), puts back the
  functions a test replaced in ``torch.nn.functional`` (DeepSpeed's ``zero.Init`` replaces ``linear``),
  stops the processes a test left running under the worker (Megatron's checkpoint writer keeps a
  queue manager), and returns :func:`probe`'s numbers;
* :func:`probe`: the threads, process groups, child processes and resident memory of this rank.

Note [What a gloo group leaves behind]: each gloo process group owns a TCP device loop
(``gloo_tcp_loop``) and two work threads (``pt_gloo_runloop``), which end only when the last Python
reference to the group is gone. ``destroy_process_group`` drops torch's own reference; a cache that
still holds the group (a layout's groups, Megatron's or DeepSpeed's module globals, an ``lru_cache``
keeping a model and its DDP buffers) keeps the threads alive. A worker that served a few hundred
tests this way held 500 threads and slowed every rank of the machine, so after a reset the probe
must find the threads of a fresh worker again.
"""
from __future__ import annotations

import functools
import gc
import multiprocessing
import os
import sys
import threading
from typing import Any

import torch
import torch.distributed as dist

from megatron_ring.integrations.deepspeed.process_group import forget_deepspeed_groups
from megatron_ring.parallel.groups import destroy_groups

_FUNCTIONAL: dict[str, Any] = {}
"""``torch.nn.functional``'s public attributes as the worker started."""
GLOO_THREAD_NAMES = ("gloo_tcp_loop", "pt_gloo_runloop")
WORLD_GLOO_THREADS = 3
"""The gloo threads of the world group once it has run collectives (one TCP loop, two work threads)."""
_LRU_CACHES: dict[int, Any] = {}
"""Megatron's and DeepSpeed's ``lru_cache`` wrappers seen so far (module-level: they live as long as the worker)."""

# Note [Frozen survivors]
# ~~~~~~~~~~~~~~~~~~~~~~~
# A framework rank holds about half a million objects after its imports (Megatron-core, DeepSpeed,
# transformers), and the full collection of every reset walked them all: 0.3 s of CPU per rank
# per module. What survives a reset is the worker's own state (modules, their globals), so the
# reset ends with ``gc.freeze()``: survivors move to the permanent generation, which no collection
# walks, and the next reset's ``gc.collect()`` only walks what the module's tests made. A cycle
# through a frozen object is never collected, so when the probe still finds a gloo group the reset
# unfreezes everything and collects again before it reports: a leak is one that a full
# collection cannot free, as before. ``gc.get_objects`` skips frozen objects too, hence
# ``_LRU_CACHES``.


def snapshot() -> None:
    """Remember ``torch.nn.functional`` as it is now (call once, when the worker starts)."""
    functional = torch.nn.functional
    _FUNCTIONAL.update({name: value for name, value in vars(functional).items() if not name.startswith("_")})


def probe() -> dict[str, float]:
    """This rank's ``{"threads", "gloo_threads_added", "groups", "children", "rss_mb"}``: threads of the
    process, gloo threads beyond the world group's (each other gloo group alive holds up to three),
    live process groups (the world included), child processes and resident memory."""
    names = _thread_names()
    groups = len(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else 0
    return {"threads": sum(names.values()), "gloo_threads_added": max(0, names.get("gloo", 0) - WORLD_GLOO_THREADS),
            "groups": groups, "children": len(multiprocessing.active_children()),
            "rss_mb": round(_rss_bytes() / 2**20, 1)}


def reset() -> dict[str, float]:
    """Tear down what tests left in this worker (see the module's docstring) and return :func:`probe`."""
    _forget_framework_state()
    _forget_own_groups()
    destroy_groups()
    _stop_children()
    functional = torch.nn.functional
    for name, value in _FUNCTIONAL.items():
        if getattr(functional, name, None) is not value:
            setattr(functional, name, value)
    gc.collect()  # a gloo group's destructor joins its threads; see Note [Frozen survivors]
    found = probe()
    if found["gloo_threads_added"] or found["groups"] > 1:  # maybe a cycle through a frozen object
        gc.unfreeze()
        gc.collect()
        found = probe()
    gc.freeze()
    return found


def _stop_children() -> None:
    """Terminate (then kill) the processes tests started under this worker."""
    children = multiprocessing.active_children()
    for child in children:
        child.terminate()
    for child in children:
        child.join(timeout=5)
        if child.is_alive():
            child.kill()
            child.join(timeout=5)


def _forget_own_groups() -> None:
    from megatron_ring.parallel import groups

    groups._CREATED.clear()
    state = sys.modules.get("megatron_ring.integrations.megatron.state")
    if state is not None:
        state._OWN_GROUPS.clear()
        state._own_minutes = None
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:  # compiled code and its guards hold the groups it was traced with
        dynamo.reset()
        _forget_compiled_functions()
    bench = sys.modules.get("megatron_ring.perf.bench.attention_worker")
    if bench is not None:  # the single-process baseline's group of rank 0
        bench._SOLO = None


def _forget_framework_state() -> None:
    """Megatron's and DeepSpeed's module globals that hold process groups or models, where those are loaded."""
    if sys.modules.get("megatron.core.parallel_state") is not None:
        from megatron_ring.integrations.megatron.state import forget_parallel_state

        forget_parallel_state()
    writer = sys.modules.get("megatron.core.dist_checkpointing.strategies.filesystem_async")
    if writer is not None:  # the checkpoint writer's queue lives in a manager process, stopped below
        writer._results_queue = None
    for cached in _framework_lru_caches():  # a method's lru_cache is keyed on its object and keeps it alive
        cached.cache_clear()
    forget_deepspeed_groups()
    offload = sys.modules.get("deepspeed.runtime.zero.parameter_offload")
    if offload is not None:  # ZeRO-3's stack of modules in forward keeps the last model (and its groups)
        offload.FWD_MODULE_STACK.clear()


def _forget_compiled_functions() -> None:
    """Drop what dynamo installed in the globals of the modules whose functions it compiled
    (``__compiled_fn_N``, ``__resume_at_N``): their graphs hold the groups they were traced with, and
    ``torch._dynamo.reset`` leaves them there."""
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict):
            for name in [n for n in namespace if n.startswith(("__compiled_fn", "__resume_at"))]:
                del namespace[name]


def _framework_lru_caches() -> list[Any]:
    """Every ``functools.lru_cache`` of Megatron's and DeepSpeed's code: Megatron's ``RotaryEmbedding.forward``
    keeps the last 32 models, DeepSpeed's ``PartitionedParameterCoordinator.__params_to_release`` the last
    ZeRO-3 coordinators, with their parameters and process groups. ``gc.get_objects`` does not list
    frozen objects (Note [Frozen survivors]): those found before are remembered."""
    _LRU_CACHES.update({id(obj): obj for obj in gc.get_objects()
                        if type(obj) is functools._lru_cache_wrapper
                        and getattr(obj, "__module__", None) and obj.__module__.startswith(("megatron.", "deepspeed."))})
    return list(_LRU_CACHES.values())


def _thread_names() -> dict[str, int]:
    """``{"gloo": n, "other": m}``: this process's threads by kind (Linux names them in /proc)."""
    if not os.path.isdir("/proc/self/task"):
        return {"other": threading.active_count()}
    counts = {"gloo": 0, "other": 0}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                name = comm.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        counts["gloo" if name in GLOO_THREAD_NAMES else "other"] += 1
    return counts


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0
