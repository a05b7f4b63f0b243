"""Run-time reporting shared by inference and training: peak memory, freed memory returned, atomic JSON,
progress bars."""
from __future__ import annotations

import json
import os
import resource
import tempfile
from pathlib import Path
from typing import Any

import torch


# --- memory ----------------------------------------------------------------------------------

def reset_peak_memory(device: torch.device) -> None:
    """Start a new device-peak window (GPUs; process RSS peaks cannot be reset)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> dict[str, int | None]:
    """``peak_device_bytes`` (allocator peak since the last reset; None on CPU) and
    ``peak_rss_bytes`` (the process's lifetime peak resident set, all devices)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    dev = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"peak_device_bytes": dev, "peak_rss_bytes": rss}


def return_freed_memory() -> bool:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``); False where there is none.

    Note [Freed memory and RSS]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~
    A server's caches come and go in every size (each decode step grows a shard by one token; an
    evicted conversation frees megabytes). glibc raises its mmap threshold after each large free, so
    later blocks of those sizes come from the heap, where a freed block between live ones stays
    resident: a serving rank's RSS grew by 1 GB over 50 requests with a bounded cache, all of it free
    memory. ``malloc_trim`` returns those pages; it costs milliseconds, so the server calls it when a
    request finishes.
    """
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is None:
        return False
    trim(0)
    return True


# --- output ----------------------------------------------------------------------------------

def write_json_atomic(path: str | Path, data: Any) -> Path:
    """Write ``data`` as JSON so that ``path`` is either absent/old or complete, never partial.

    The text goes to a temporary file in the same directory, is fsynced, then renamed over
    ``path`` (``os.replace`` is atomic on POSIX within one file system).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=2, sort_keys=False)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def progress(total: int, *, enabled: bool, desc: str) -> Any:
    """A tqdm progress bar on stderr when ``enabled`` (rank 0) and tqdm is installed, else a no-op."""
    if enabled:
        try:
            from tqdm import tqdm

            return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, mininterval=1.0)
        except ImportError:
            pass
    return _NoBar()


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass

