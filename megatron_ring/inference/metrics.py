"""Inference metrics: definitions, the communication counter, result tables.

Definitions (one *request* = prefill of ``batch`` prompts of ``prompt_len`` tokens, then
``new_tokens - 1`` decode steps; every data-parallel replica serves one request at a time)::

    TTFT            = prefill time (prefill produces the first new token)
    TPOT            = time of one decode step (one new token for each sequence); mean, p50, p99
                      over the steps of a request
    prefill TPS     = dp * batch * prompt_len        / prefill time
    decode TPS      = dp * batch * (new_tokens - 1)  / decode time
    overall TPS     = dp * batch * (prompt_len + new_tokens - 1) / (prefill + decode time)
    e2e per token   = (prefill + decode time) / new_tokens          (the paper's "TPOT")

A step's time is the slowest rank's. Warmup requests are not measured; each metric of the run is
the median over the measured requests. Per rank: peak memory (device allocator peak on GPUs,
process peak RSS on CPU) and the bytes this rank *sent* per request, prefill and decode apart,
counted by :class:`CommCounter`.
"""
from __future__ import annotations

import math
import statistics
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between closest ranks."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass
class RequestTiming:
    """Wall-clock seconds of one request: its prefill and each decode step (slowest rank)."""

    prefill_s: float
    step_s: list[float] = field(default_factory=list)


def request_metrics(timing: RequestTiming, *, sequences: int, prompt_len: int) -> dict[str, float]:
    """The metrics of one request; ``sequences = dp * batch``."""
    if not timing.step_s:
        raise ValueError("a request needs at least one decode step (new_tokens >= 2)")
    decode_s = sum(timing.step_s)
    total_s = timing.prefill_s + decode_s
    steps = len(timing.step_s)
    return {
        "ttft_ms": timing.prefill_s * 1e3,
        "tpot_mean_ms": decode_s / steps * 1e3,
        "tpot_p50_ms": percentile(timing.step_s, 50) * 1e3,
        "tpot_p99_ms": percentile(timing.step_s, 99) * 1e3,
        "prefill_tps": sequences * prompt_len / timing.prefill_s,
        "decode_tps": sequences * steps / decode_s,
        "overall_tps": sequences * (prompt_len + steps) / total_s,
        "e2e_per_token_ms": total_s / (steps + 1) * 1e3,
        "prefill_s": timing.prefill_s,
        "decode_s": decode_s,
    }


def median_metrics(per_request: Sequence[dict[str, float]]) -> dict[str, float]:
    """Key-wise median over requests."""
    if not per_request:
        raise ValueError("no measured request")
    return {key: statistics.median(m[key] for m in per_request) for key in per_request[0]}


# --- communication ---------------------------------------------------------------------------

def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _size(group: Any) -> int:
    return dist.get_world_size(group) if group is not None else dist.get_world_size()


def _arg(args: tuple, kwargs: dict, index: int, name: str) -> Any:
    return args[index] if len(args) > index else kwargs.get(name)


# Bytes a rank sends for one call, with the ring algorithms NCCL and gloo use for large messages
# (n = group size): all-reduce 2(n-1)/n of the buffer, all-gather and reduce-scatter (n-1) shards,
# all-to-all (n-1)/n, broadcast one buffer, p2p the tensor. Receives count on the sender only.
_SENT: dict[str, Callable[[tuple, dict], float]] = {
    "send": lambda a, k: _nbytes(_arg(a, k, 0, "tensor")),
    "isend": lambda a, k: _nbytes(_arg(a, k, 0, "tensor")),
    "all_reduce": lambda a, k: 2 * (_size(_arg(a, k, 2, "group")) - 1) / _size(_arg(a, k, 2, "group"))
    * _nbytes(_arg(a, k, 0, "tensor")),
    "all_gather": lambda a, k: (_size(_arg(a, k, 2, "group")) - 1) * _nbytes(_arg(a, k, 1, "tensor")),
    "all_gather_into_tensor": lambda a, k: (_size(_arg(a, k, 2, "group")) - 1)
    * _nbytes(_arg(a, k, 1, "input_tensor")),
    "all_gather_single": lambda a, k: (_size(_arg(a, k, 2, "group")) - 1) * _nbytes(_arg(a, k, 1, "input_tensor")),
    "reduce_scatter": lambda a, k: (_size(_arg(a, k, 3, "group")) - 1) * _nbytes(_arg(a, k, 0, "output")),
    "reduce_scatter_tensor": lambda a, k: (_size(_arg(a, k, 3, "group")) - 1) * _nbytes(_arg(a, k, 0, "output")),
    "reduce_scatter_single": lambda a, k: (_size(_arg(a, k, 3, "group")) - 1) * _nbytes(_arg(a, k, 0, "output")),
    "all_to_all_single": lambda a, k: (_size(_arg(a, k, 4, "group")) - 1) / _size(_arg(a, k, 4, "group"))
    * _nbytes(_arg(a, k, 1, "input")),
    "broadcast": lambda a, k: _nbytes(_arg(a, k, 0, "tensor")) if _size(_arg(a, k, 2, "group")) > 1 else 0,
}


class CommCounter:
    """Counts the bytes this rank sends through ``torch.distributed`` while :meth:`active`.

    Note [Counting communication]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    The counter wraps the collectives and ``send``/``isend`` in both ``torch.distributed`` and
    ``torch.distributed.distributed_c10d`` (so ``P2POp(dist.isend, ...)`` and
    ``batch_isend_irecv`` pass through it and still validate), for the span of :meth:`active`
    only. It sees every call made through the module attribute (``dist.all_reduce(...)``), which
    is how torch, Megatron-core and this package call them; a function imported by name before
    the counter was activated is not seen. Only the outermost counted call counts, so a deprecated
    alias that forwards to its new name (``all_gather_into_tensor`` -> ``all_gather_single``) or an
    object collective built on a tensor one is counted once. Volumes follow the ring algorithms
    (see ``_SENT``), so they compare layouts, not wire-level bytes of a particular library.
    """

    def __init__(self) -> None:
        self.phase = "idle"
        self.sent: dict[str, dict[str, float]] = {}
        self._depth = 0

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        size_of = _SENT[name]

        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:
                by_op = self.sent.setdefault(self.phase, {})
                by_op[name] = by_op.get(name, 0.0) + size_of(args, kwargs)
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1

        counted.__name__ = counted.__qualname__ = name
        counted.__wrapped__ = fn  # type: ignore[attr-defined]
        return counted

    @contextmanager
    def active(self) -> Iterator["CommCounter"]:
        """Count inside the block; the original functions are restored on exit."""
        saved = {name: getattr(c10d, name) for name in _SENT if hasattr(c10d, name)}
        try:
            for name, fn in saved.items():
                wrapped = self._wrap(name, fn)
                setattr(c10d, name, wrapped)
                setattr(dist, name, wrapped)
            yield self
        finally:
            for name, fn in saved.items():
                setattr(c10d, name, fn)
                setattr(dist, name, fn)

    def total(self, phase: str) -> float:
        return sum(self.sent.get(phase, {}).values())


METRIC_ROWS: tuple[tuple[str, str, str], ...] = (
    ("overall_tps", "TPS overall", "tok/s"),
    ("prefill_tps", "TPS prefill", "tok/s"),
    ("decode_tps", "TPS decode", "tok/s"),
    ("ttft_ms", "TTFT", "ms"),
    ("tpot_mean_ms", "TPOT mean", "ms"),
    ("tpot_p50_ms", "TPOT p50", "ms"),
    ("tpot_p99_ms", "TPOT p99", "ms"),
    ("e2e_per_token_ms", "e2e / new token", "ms"),
)
"""(metric key, label, unit) in table order."""

RANK_ROWS: tuple[tuple[str, str, str], ...] = (
    ("peak_mem_bytes", "peak memory / rank (max)", "MiB"),
    ("kv_cache_bytes", "KV cache / rank (max)", "MiB"),
    ("comm_prefill_bytes", "sent in prefill / rank (max)", "MiB"),
    ("comm_decode_bytes", "sent in decode / rank (max)", "MiB"),
)
"""(per-rank key, label, unit): rows showing the maximum over ranks."""


def rank_max(result: dict[str, Any], key: str) -> float:
    """Maximum of a per-rank value over the ranks of a result."""
    return max(float(r[key] or 0) for r in result["ranks"])


def _fmt(value: float, unit: str) -> str:
    if unit == "MiB":
        return f"{value / 2**20:,.2f}"
    if unit == "tok/s":
        return f"{value:,.1f}"
    return f"{value:,.3f}"


def format_table(results: Sequence[dict[str, Any]], *, ratios: bool = False) -> str:
    """A plain-text table of one or more results side by side.

    With ``ratios``, a last column gives ``last / first`` for every row (e.g. ring / baseline).
    """
    heads = ["metric", "unit"] + [f"{r['name']} ({r['layout_text']})" for r in results]
    if ratios:
        heads.append(f"{results[-1]['name']} / {results[0]['name']}")
    rows = []
    for key, label, unit in METRIC_ROWS:
        values = [r["metrics"][key] for r in results]
        rows.append((label, unit, values))
    for key, label, unit in RANK_ROWS:
        rows.append((label, unit, [rank_max(r, key) for r in results]))
    lines = [heads]
    for label, unit, values in rows:
        line = [label, unit] + [_fmt(v, unit) for v in values]
        if ratios:
            line.append(f"{values[-1] / values[0]:.3f}x" if values[0] else "n/a")
        lines.append(line)
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(heads))]
    out = []
    for n, line in enumerate(lines):
        cells = [str(c).ljust(w) if i < 2 else str(c).rjust(w) for i, (c, w) in enumerate(zip(line, widths))]
        out.append("  ".join(cells).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)
