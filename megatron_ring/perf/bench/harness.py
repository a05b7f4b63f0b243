"""What every benchmark shares: timing, the memory high-water mark, the machine's description, gloo pools.

Note [Ranks and the scheduler]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Linux with ``sched_autogroup_enabled`` shares the CPU fairly between *sessions*, not processes.
On a machine where other sessions are busy, the P ranks of one session would together get the
share of one process — the same CPU as the single-process baseline — and the measured
efficiency would be capped near ``1/P`` by the scheduler, not by the ring. Each worker therefore
starts its own session (``os.setsid``, hence its own autogroup), as each rank would own its own
device; the single baseline runs in one. On a quiet machine this changes nothing.

Note [Peak memory on CPU]
~~~~~~~~~~~~~~~~~~~~~~~~~
Each worker sets glibc's ``M_MMAP_THRESHOLD`` to 64 KiB (``mallopt``), so every tensor buffer
above 64 KiB is its own ``mmap`` and returns to the OS when freed: resident memory then follows
the live tensors. Before one extra, untimed call the worker resets the kernel's high-water mark
(``/proc/self/clear_refs`` <- 5) and afterwards reads ``VmHWM``; peak memory = ``VmHWM`` minus the
resident size just before the call (inputs already allocated, so it counts what the call adds:
buffers, temporaries, outputs, saved tensors and gradients). Buffers under 64 KiB are not seen.
On CUDA it is ``torch.cuda.max_memory_allocated`` minus the allocation before the call.
"""
from __future__ import annotations

import ctypes
import os
import platform
import statistics
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
"""The dtypes the benchmarks take, by the names their flags and JSON use."""
CAUSAL: dict[str, list[bool]] = {"yes": [True], "no": [False], "both": [True, False]}
"""``--causal``: the masks a benchmark runs."""
_M_MMAP_THRESHOLD = -3


# ---------------------------------------------------------------------------------------------
# timing


def barrier_timed(fn: Callable[[], Any], calls: int = 1) -> float:
    """Seconds per call of ``fn`` on this rank, every rank starting together after a barrier;
    ``calls`` calls back to back, so the skew with which ranks leave the barrier is shared out."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def slowest(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Per repeat, the slowest rank's time (ranks with no times ignored)."""
    return [max(times) for times in zip(*(r for r in per_rank if r))]


def slowest_median(per_rank: Sequence[Sequence[float]]) -> float:
    """Median over repeats of :func:`slowest`."""
    return statistics.median(slowest(per_rank))


def median_time(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` on one device after one warm-up (CUDA events on GPU)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


# ---------------------------------------------------------------------------------------------
# memory and the scheduler (worker side)


def own_session() -> None:
    """Put this worker in a scheduler autogroup of its own (see Note [Ranks and the scheduler])."""
    if os.getsid(0) != os.getpid():
        os.setsid()


def track_mmap() -> None:
    """Make every allocation above 64 KiB an mmap of its own (see Note [Peak memory on CPU])."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 64 * 1024)
    except OSError:  # not glibc: RSS is then an upper bound
        pass


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not found in /proc/self/status")


def measure_peak(call: Callable[[], None], device: torch.device) -> int:
    """Bytes a call adds at its peak (CUDA allocator, or RSS high-water mark on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        call()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    base = _rss_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    call()
    return max(0, _rss_bytes("VmHWM") - base)


# ---------------------------------------------------------------------------------------------
# the machine and the pools (driver side)


def machine_description() -> dict[str, Any]:
    """What the numbers ran on."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), cpu)
    except OSError:
        pass
    desc = {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform(), "loadavg_1_5_15": list(os.getloadavg())}
    if torch.cuda.is_available():
        desc["gpu"] = torch.cuda.get_device_name(0)
    return desc


@contextmanager
def borrow_pool(pools: Callable[[int, int], Any] | None, size: int, threads: int, timeout_s: float) -> Iterator[Any]:
    """A pool of ``size`` ranks: borrowed from ``pools(size, threads)`` (left open) or started and closed here."""
    from megatron_ring.runtime.pool import GlooPool

    if pools is not None:
        yield pools(size, threads)
        return
    with GlooPool(size, timeout_s=timeout_s, threads=threads) as pool:
        yield pool
