"""Process groups under DeepSpeed's launcher: torch.distributed from the launcher's environment, and
DeepSpeed's comm backend on top of it.

Note [Process group without DeepSpeed's comm backend]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``deepspeed.init_distributed`` builds DeepSpeed's comm backend, which on the CPU accelerator
JIT-compiles a shared-memory all-reduce op on first use (about 80 s and a C++ toolchain, on every
fresh machine). We need none of it: the ring, the decode merge and Megatron's TP/PP traffic all go
through ``torch.distributed``. So :func:`init_distributed` starts torch's process group itself from
the variables every launcher sets (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
``LOCAL_RANK`` — the DeepSpeed launcher and torchrun alike), gloo on CPU and NCCL on GPUs, and
:func:`~megatron_ring.integrations.deepspeed.inference_engine.init_inference` calls ``deepspeed.init_inference`` with ``tensor_parallel.tp_size = 1``,
a path that never touches ``deepspeed.comm``. The Megatron model is already tensor-parallel
through its own layers; DeepSpeed's AutoTP (what ``tp_size > 1`` turns on) would try to shard it
a second time. DeepSpeed still converts the weights to ``dtype`` and places them on the device.
"""
from __future__ import annotations

from __future__ import annotations

import importlib
import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def launch_env() -> dict[str, int]:
    """``rank``, ``world_size``, ``local_rank`` from the launcher's environment (1 process if none)."""
    return {
        "rank": int(os.environ.get("RANK", "0")),
        "world_size": int(os.environ.get("WORLD_SIZE", "1")),
        "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
    }


def select_device(local_rank: int) -> tuple[torch.device, str]:
    """(device, backend): ``cuda:<local_rank>`` + nccl when a GPU is usable and ``DS_ACCELERATOR`` is
    not ``cpu``; else ``cpu`` + gloo, with the cores shared between this host's ranks (the
    launchers set ``LOCAL_WORLD_SIZE`` (torchrun) or ``LOCAL_SIZE`` (DeepSpeed))."""
    if os.environ.get("DS_ACCELERATOR", "") != "cpu" and torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    if "OMP_NUM_THREADS" not in os.environ:  # share the cores, or N ranks oversubscribe them N-fold
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    return torch.device("cpu"), "gloo"


def init_distributed(*, timeout: timedelta) -> tuple[torch.device, str]:
    """Start torch.distributed from the launcher's environment (see Note above); return (device, backend).

    A single process started without a launcher gets a one-rank group on a free loopback port.
    """
    env = launch_env()
    device, backend = select_device(env["local_rank"])
    if "MASTER_ADDR" not in os.environ:
        if env["world_size"] != 1:
            raise RuntimeError(f"WORLD_SIZE={env['world_size']} but MASTER_ADDR is not set; start with a launcher")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=env["rank"], world_size=env["world_size"], timeout=timeout,
                            device_id=device if device.type == "cuda" else None)
    return device, backend



def init_deepspeed_comm() -> None:
    """Give DeepSpeed its comm backend on top of our already started torch.distributed.

    Note [DeepSpeed's comm backend without the shared-memory op]: DeepSpeed's engine and AutoTP
    need ``deepspeed.comm`` (its ``TorchBackend``), whose constructor JIT-compiles a shared-memory
    all-reduce op on the CPU accelerator (about 80 s and a C++ toolchain on every fresh machine).
    That op serves only ``inference_all_reduce``, so while the backend is created
    ``build_shm_op`` answers "not available"; every collective then goes through
    ``torch.distributed`` as usual. (The inference launch avoids ``deepspeed.comm`` altogether.)
    """
    import deepspeed.comm as ds_comm

    if ds_comm.is_initialized():
        return
    if not dist.is_initialized():
        raise RuntimeError("init_deepspeed_comm needs torch.distributed to be initialised first")
    ds_torch = importlib.import_module("deepspeed.comm.torch")  # the attribute ds_comm.torch is torch itself
    build_shm_op = ds_torch.build_shm_op
    ds_torch.build_shm_op = lambda: None
    try:
        ds_comm.init_distributed(dist_backend=dist.get_backend(), verbose=False)
    finally:
        ds_torch.build_shm_op = build_shm_op


def forget_deepspeed_groups() -> None:
    """Drop the process groups DeepSpeed's ``groups`` module keeps (its ``mpu`` and every ``_..._GROUP``
    global), where DeepSpeed is loaded; the groups themselves live on until
    :func:`~megatron_ring.parallel.groups.destroy_groups`."""
    ds_groups = sys.modules.get("deepspeed.utils.groups")
    if ds_groups is None:
        return
    ds_groups.mpu = None
    for name, value in vars(ds_groups).items():
        if name.startswith("_") and name.endswith(("_GROUP", "_GROUP_RANKS")):
            setattr(ds_groups, name, {} if isinstance(value, dict) else None)
