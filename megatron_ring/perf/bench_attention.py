"""``megatron-ring bench attention``: ring (p2p) vs all-gather vs all-to-all (a2a, a2a+p2p) vs single process vs DeepSpeed Ulysses.

Every point runs on ``P`` gloo processes (CPU) started by :class:`~megatron_ring.runtime.pool.GlooPool`
with ``threads = max(1, cores // P)`` each, so ranks do not oversubscribe the cores while
``P <= cores``. The single-process baseline is ``ring_attention`` on rank 0 alone (a one-rank
group) with the same threads, i.e. one rank's share of the machine: efficiency
``T_single / (P * T)`` then means what it means on GPUs (one device per rank). When ``P > cores``
the ranks share cores and the best possible efficiency is ``cores / P``;
``eff/core = T_single / (min(P, cores) * T)`` corrects for that.

The implementations of one point are interleaved (repeat r runs each once, in turn, starting
with the r-th: the order rotates, so none always runs right after the same other), so on a
shared machine they all see the same load. (With a fixed order, the all-gather measured 1.21x
of the fastest when it ran right after the ring, 1.09x when it ran first.) Per point: median /
min / max over ``repeats`` of the slowest rank's wall time (ranks start together after a
barrier); exposed communication = the ring's instrumented wait after compute
(:func:`megatron_ring.attention.instrument.ring_stats`) / wall time (for all-gather, forward only:
the share of the call outside the block kernels); bytes sent per rank per call (forward, from the
instrumentation; for Ulysses computed from the four all-to-alls; ``bytes_sent`` is rank 0's,
``bytes_sent_max`` the largest over ranks, which differ under a window); peak memory per rank. A
second table gives the bytes every comm sends per rank per layer at each (L, P), from the formulas
(:func:`comm_bytes`), so comms that were not run can be compared too.

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

Variants (``--window``, ``--docs``, ``--dilation``): with ``--window W`` every ring implementation (single,
ring_p2p, all_gather) also runs with ``window_size=(W, 0)`` (causal; ``(W, W)`` otherwise), and
with ``--docs N`` as N equal documents of L/N tokens, once packed (one call with ``cu_seqlens``)
and once one by one (N calls, timed together); with ``--a2a-contiguous`` ``a2a`` also runs on
contiguous shards, the layout DeepSpeed-Ulysses is given (plain ``a2a`` gets zigzag shards, as
the ring, and puts the tokens in order after its all-to-all); with ``--dilation 2048:1,4096:2``
every ring implementation also runs LongNet's dilated attention with those pairs. A point's ``variant`` names it
("" = plain). All variants of a point are interleaved like the implementations.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from megatron_ring.runtime.args import non_negative_int, positive_float, positive_int, usage_error

IMPLS: tuple[str, ...] = ("single", "ring_p2p", "all_gather", "a2a", "a2a+p2p", "ulysses")
RING_IMPLS: tuple[str, ...] = ("single", "ring_p2p", "all_gather")
"""The implementations that take a window and packed documents (the variants)."""
VARIANT_IMPLS: dict[str, tuple[str, ...]] = {"window": RING_IMPLS, "packed": RING_IMPLS, "separate": RING_IMPLS,
                                             "contiguous": ("a2a",), "dilated": RING_IMPLS}
_COMM_OF = {"single": "p2p", "ring_p2p": "p2p", "all_gather": "all_gather", "a2a": "a2a", "a2a+p2p": "a2a+p2p"}
MODES: tuple[str, ...] = ("fwd", "fwd_bwd")
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_M_MMAP_THRESHOLD = -3


def ulysses_available() -> bool:
    """Whether ``deepspeed.sequence.layer.DistributedAttention`` can be imported."""
    try:
        from deepspeed.sequence.layer import DistributedAttention  # noqa: F401
    except Exception:  # deepspeed missing, or failing to initialise its accelerator
        return False
    return True


# ---------------------------------------------------------------------------------------------
# worker side (runs in every gloo rank)


def _own_session() -> None:
    """Put this worker in a scheduler autogroup of its own (see Note [Ranks and the scheduler])."""
    if os.getsid(0) != os.getpid():
        os.setsid()


def _track_mmap() -> None:
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


def _measure_peak(call: Callable[[], None], device: torch.device) -> int:
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


def _solo_group() -> dist.ProcessGroup:
    """A group holding only rank 0, for the single-process baseline inside a P-rank pool (collective, cached)."""
    global _SOLO
    if _SOLO is None:
        _SOLO = dist.new_group([0])
    return _SOLO


_SOLO: dist.ProcessGroup | None = None


def _window_size(cfg: dict[str, Any]) -> tuple[int, int]:
    """``--window W`` as flash-attn's ``(left, right)``: ``(W, 0)`` causal, ``(W, W)`` otherwise."""
    w = cfg.get("window") or -1
    return (w, 0 if cfg["causal"] else w) if w > 0 else (-1, -1)


def _cu_seqlens(cfg: dict[str, Any]) -> torch.Tensor:
    """N equal documents of L/N tokens."""
    n = cfg["docs"]
    return torch.arange(0, cfg["L"] + 1, cfg["L"] // n, dtype=torch.int32)


def _make_attention(cfg: dict[str, Any]) -> Callable[..., torch.Tensor]:
    from megatron_ring import ring_attention

    impl, causal, backend = cfg["impl"], cfg["causal"], cfg["backend"]
    if impl in _COMM_OF:
        comm = _COMM_OF[impl]
        group: Any = _solo_group() if impl == "single" else None
        if impl == "a2a+p2p":
            from megatron_ring import ParallelLayout, init_parallel

            group = init_parallel(ParallelLayout(cp=dist.get_world_size(), cp_a2a=cfg.get("a2a_size", 2))).cp_groups
        window = _window_size(cfg)
        cu = _cu_seqlens(cfg) if cfg.get("variant") == "packed" else None
        dilation = cfg.get("dilation") if cfg.get("variant") == "dilated" else None

        sharding = _sharding(cfg)

        def ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return ring_attention(q, k, v, group, causal=causal, comm=comm, backend=backend, window_size=window,
                                  cu_seqlens=cu, sharding=sharding, dilation=dilation)
        if cfg.get("variant") == "separate":  # [docs, batch, seq_local, heads, dim]: one call per document
            return lambda q, k, v: torch.stack([ring(q[i], k[i], v[i]) for i in range(q.shape[0])])
        return ring
    import deepspeed.comm
    from deepspeed.sequence.layer import DistributedAttention

    if not deepspeed.comm.is_initialized():  # adopts the gloo group torch.distributed already has
        deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)

    def local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        groups = q.shape[2] // k.shape[2]
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, enable_gqa=groups > 1)
        return out.transpose(1, 2)

    dist_attn = DistributedAttention(local, dist.group.WORLD, scatter_idx=2, gather_idx=1)

    def ulysses(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return dist_attn(q, k, v, 0)
    return ulysses


def _sharding(cfg: dict[str, Any]) -> str:
    """How a point's inputs are sharded: contiguous for Ulysses and the ``contiguous`` variant, else zigzag."""
    return "contiguous" if cfg["impl"] == "ulysses" or cfg.get("variant") == "contiguous" else "zigzag"


def _inputs(cfg: dict[str, Any], rank: int, size: int, device: torch.device) -> list[torch.Tensor]:
    """This rank's q, k, v (and dout): one global tensor per name from a fixed seed, then sharded.

    The single-process baseline gets the global tensors (on rank 0; the other ranks idle).
    """
    from megatron_ring.attention.sharding import shard_sequence

    gen = torch.Generator().manual_seed(cfg["seed"])
    b, seq, h, hkv, d = cfg["batch"], cfg["L"], cfg["heads"], cfg["heads_kv"], cfg["head_dim"]
    shapes = [(b, seq, h, d), (b, seq, hkv, d), (b, seq, hkv, d), (b, seq, h, d)]
    sharding = _sharding(cfg)
    sharded = size > 1 and cfg["impl"] != "single"
    out = []
    for shape in shapes:
        full = torch.randn(shape, generator=gen)
        if cfg.get("variant") == "packed":  # [tokens, heads, dim]
            cu = _cu_seqlens(cfg)
            local = shard_sequence(full[0], rank, size, dim=0, cu_seqlens=cu) if sharded else full[0]
        elif cfg.get("variant") == "separate":  # [docs, batch, seq_local, heads, dim]
            docs = full.split(seq // cfg["docs"], dim=1)
            local = torch.stack([shard_sequence(d, rank, size) if sharded else d for d in docs])
        else:
            local = shard_sequence(full, rank, size, sharding=sharding) if sharded else full
        out.append(local.to(device=device, dtype=DTYPES[cfg["dtype"]]).contiguous())
    return out


class _Case:
    """One implementation of one point on this rank: inputs, the call, and what it measured."""

    def __init__(self, cfg: dict[str, Any], rank: int, size: int) -> None:
        self.cfg = cfg
        self.device = torch.device(cfg["device"])
        self.active = cfg["impl"] != "single" or rank == 0
        self.grad = cfg["mode"] == "fwd_bwd"
        self.attn = _make_attention(cfg)
        self.tensors = _inputs(cfg, rank, size, self.device) if self.active else []
        for t in self.tensors[:3]:
            t.requires_grad_(self.grad)
        self.times: list[float] = []
        self.wait = self.compute = self.total = 0.0
        self.sent = self.calls = 0

    def call(self) -> None:
        if not self.active:
            return
        q, k, v, dout = self.tensors
        out = self.attn(q, k, v)
        if self.grad:
            out.backward(dout)
            for t in (q, k, v):
                t.grad = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed(self) -> None:
        from megatron_ring.attention.transport import ring_stats

        with ring_stats() as stats:
            t0 = time.perf_counter()
            self.call()
            self.times.append(time.perf_counter() - t0)
        self.wait += stats.wait_s
        self.compute += stats.compute_s
        self.total += stats.total_s
        self.sent += stats.bytes_sent
        self.calls += stats.calls

    def result(self, peak: int) -> dict[str, Any]:
        return {"active": self.active, "times": self.times, "wait_s": self.wait, "compute_s": self.compute,
                "ring_total_s": self.total, "bytes_sent": self.sent / len(self.times) if self.calls else None,
                "peak_mem_bytes": peak}


def bench_worker(cfgs: list[dict[str, Any]], repeats: int, warmup: int) -> list[dict[str, Any]]:
    """Time several implementations of one point on this rank, interleaved.

    Repeat r runs every implementation once (after a barrier each), starting with the r-th, so all
    of them see the same machine load and every position in the order; returns per implementation
    the times, instrumentation and peak memory.
    """
    _track_mmap()
    if cfgs and cfgs[0].get("own_session"):
        _own_session()
    rank, size = dist.get_rank(), dist.get_world_size()
    cases = [_Case(cfg, rank, size) for cfg in cfgs]
    for case in cases:
        for _ in range(warmup):
            case.call()
    for r in range(repeats):
        for case in cases[r % len(cases):] + cases[:r % len(cases)]:
            dist.barrier()
            case.timed()
    results = []
    for case in cases:
        dist.barrier()
        results.append(case.result(_measure_peak(case.call, case.device)))
    return results


# ---------------------------------------------------------------------------------------------
# driver


def _ulysses_bytes(cfg: dict[str, Any], size: int) -> float:
    """Bytes each rank sends in Ulysses' four all-to-alls (q, k, v in; output back), twice with backward."""
    s = torch.tensor([], dtype=DTYPES[cfg["dtype"]]).element_size()
    local = cfg["batch"] * cfg["L"] // size * cfg["head_dim"] * s
    passes = 2 if cfg["mode"] == "fwd_bwd" else 1
    return passes * (size - 1) / size * local * (2 * cfg["heads"] + 2 * cfg["heads_kv"])


def comm_bytes(*, L: int, P: int, batch: int, heads: int, heads_kv: int, head_dim: int, dtype: str,
               a2a_size: int) -> dict[str, dict[str, float]]:
    """Bytes each rank sends for one attention layer, ``{comm: {"fwd": .., "fwd_bwd": ..}}``.

    p2p: P-1 K/V blocks; backward again, plus the fp32 dK/dV accumulator P times. all_gather:
    the same forward volume, backward a reduce-scatter of fp32 dK/dV. a2a / a2a+p2p:
    :func:`~megatron_ring.attention.alltoall.a2a_bytes`. ulysses: its four all-to-alls each way
    (fails with heads_kv % P != 0, counted as if it ran).
    """
    from megatron_ring.attention.alltoall import a2a_bytes

    e = torch.tensor([], dtype=DTYPES[dtype]).element_size()
    c = L // P
    kv = 2 * batch * c * heads_kv * head_dim
    ring_fwd = (P - 1) * kv * e
    out = {"p2p": {"fwd": ring_fwd, "fwd_bwd": 2 * ring_fwd + (P * kv * 4 if P > 1 else 0)},
           "all_gather": {"fwd": ring_fwd, "fwd_bwd": 2 * ring_fwd + (P - 1) * kv * 4}}
    shape = dict(seq_local=c, batch=batch, heads_q=heads, heads_kv=heads_kv, head_dim=head_dim, element_size=e)
    for comm, a in (("a2a", P), ("a2a+p2p", a2a_size)):
        if heads % a == 0 and P % a == 0:
            fwd = a2a_bytes(**shape, a2a_size=a, ring_size=P // a)
            out[comm] = {"fwd": fwd, "fwd_bwd": fwd + a2a_bytes(**shape, a2a_size=a, ring_size=P // a, backward=True)}
    uly = {"batch": batch, "L": L, "head_dim": head_dim, "dtype": dtype, "heads": heads, "heads_kv": heads_kv}
    out["ulysses"] = {mode: _ulysses_bytes(uly | {"mode": mode}, P) for mode in MODES}
    return out


def bytes_rows(points: list[dict[str, Any]], a2a_size: int) -> list[list[str]]:
    """One row per (L, P, comm) of the bench: bytes per rank per layer, forward and forward+backward."""
    from megatron_ring.perf.report import fmt_bytes

    rows, seen = [], set()
    for p in points:
        key = (p["L"], p["P"])
        if p["P"] < 2 or key in seen:
            continue
        seen.add(key)
        table = comm_bytes(L=p["L"], P=p["P"], batch=p["batch"], heads=p["heads"], heads_kv=p["heads_kv"],
                           head_dim=p["head_dim"], dtype=p["dtype"], a2a_size=a2a_size)
        for comm, b in table.items():
            rows.append([str(p["L"]), str(p["P"]), comm, fmt_bytes(b["fwd"]), fmt_bytes(b["fwd_bwd"])])
    return rows


def summarize(cfg: dict[str, Any], per_rank: list[dict[str, Any]], size: int) -> dict[str, Any]:
    """One JSON point from every rank's :func:`bench_worker` result for ``cfg`` (idle ranks ignored)."""
    active = [r for r in per_rank if r["active"]]
    repeats = len(active[0]["times"])
    wall = [max(r["times"][i] for r in active) for i in range(repeats)]
    timed = sum(sum(r["times"]) for r in active)
    ranks = len(active)
    if cfg["impl"] in ("ring_p2p", "a2a", "a2a+p2p"):
        exposed: float | None = sum(r["wait_s"] for r in active) / timed if ranks > 1 else 0.0
    elif cfg["impl"] == "all_gather" and cfg["mode"] == "fwd":
        ring_total = sum(r["ring_total_s"] for r in active)
        exposed = 1 - sum(r["compute_s"] for r in active) / ring_total if ring_total else None
    else:
        exposed = None
    sent = active[0]["bytes_sent"] if cfg["impl"] != "ulysses" else _ulysses_bytes(cfg, size)
    keys = ("impl", "mode", "causal", "L", "batch", "heads", "heads_kv", "head_dim", "dtype", "threads", "backend",
            "a2a_size")
    return {k: cfg[k] for k in keys} | {
        "variant": _variant_name(cfg), "window": cfg.get("window"), "docs": cfg.get("docs"),
        "dilation": cfg.get("dilation") if cfg.get("variant") == "dilated" else None,
        "P": ranks, "pool_P": size,
        "median_s": statistics.median(wall), "min_s": min(wall), "max_s": max(wall), "times_s": wall,
        "exposed_fraction": exposed, "bytes_sent": sent or 0,
        "bytes_sent_max": max((r["bytes_sent"] or 0 for r in active), default=0) if cfg["impl"] != "ulysses" else sent,
        "peak_mem_bytes": max(r["peak_mem_bytes"] for r in active),
    }


def _variant_name(cfg: dict[str, Any]) -> str:
    """"" for the plain point, else "window=W", "packed N docs" or "N docs one by one"."""
    variant = cfg.get("variant") or ""
    if variant == "window":
        return f"window={cfg['window']}"
    if variant == "packed":
        return f"packed {cfg['docs']} docs"
    if variant == "separate":
        return f"{cfg['docs']} docs one by one"
    if variant == "dilated":
        return "dilated " + ",".join(f"{w}:{r}" for w, r in cfg["dilation"])
    return variant


def add_efficiency(points: list[dict[str, Any]], cores: int) -> None:
    """Fill ``efficiency`` and ``efficiency_per_core`` from the single-process point timed in the same pool."""
    def key(p: dict[str, Any]) -> tuple[Any, ...]:
        return p["mode"], p["causal"], p["L"], p["pool_P"], p.get("variant", "")

    single = {key(p): p["median_s"] for p in points if p["impl"] == "single"}
    for p in points:
        base = single.get(key(p))
        if base is None or p["impl"] == "single":
            p["efficiency"] = p["efficiency_per_core"] = 1.0 if p["impl"] == "single" else None
            continue
        p["efficiency"] = base / (p["P"] * p["median_s"])
        p["efficiency_per_core"] = base / (min(p["P"], cores) * p["median_s"])


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


def run_sweep(*, lengths: list[int], ranks: list[int], impls: list[str], modes: list[str], causals: list[bool],
              batch: int, heads: int, heads_kv: int, head_dim: int, dtype: str, repeats: int, warmup: int,
              backend: str, seed: int = 0, timeout_s: float = 600.0, a2a_size: int = 2,
              progress: Callable[[str], None] = print,
              pools: Callable[[int, int], Any] | None = None, own_sessions: bool = True,
              window: str | int | None = None, docs: int = 0, a2a_contiguous: bool = False,
              dilation: list[tuple[int, int]] | None = None) -> list[dict[str, Any]]:
    """Run every (P, impl, mode, causal, L) point, the implementations of a point interleaved.

    ``window`` (tokens, or ``"L/k"``) and ``docs`` add the variants of the module docstring to the
    ring implementations, ``a2a_contiguous`` the contiguous one to ``a2a``, ``dilation`` (pairs
    ``(w, r)``) LongNet's dilated attention to the ring implementations.

    The single-process baseline runs on rank 0 of each P-rank pool (the others idle), with that
    pool's threads per rank, so it is timed under the same load as the points it is compared to.

    ``pools(P, threads)`` may supply running :class:`~megatron_ring.runtime.pool.GlooPool` s (left
    open, e.g. a test session's); by default each P gets its own pool, closed after its points.
    ``own_sessions`` puts each worker in its own session (Note [Ranks and the scheduler]); leave
    it off for borrowed pools, whose workers should stay in their parent's session.
    """
    if batch < 1 or heads < 1 or heads_kv < 1 or head_dim < 1 or heads % heads_kv:
        raise ValueError(f"batch, heads, heads_kv, head_dim must be >= 1 and heads % heads_kv == 0; got batch={batch}, "
                         f"heads={heads}, heads_kv={heads_kv}, head_dim={head_dim}")
    for name, values, allowed in (("impl", impls, IMPLS), ("mode", modes, MODES), ("dtype", [dtype], DTYPES)):
        bad = [x for x in values if x not in allowed]
        if bad:
            raise ValueError(f"{name} {bad} not allowed; allowed: {list(allowed)}")
    if "ulysses" in impls and not ulysses_available():
        progress("deepspeed is not installed: skipping ulysses")
        impls = [i for i in impls if i != "ulysses"]
    cores = os.cpu_count() or 1
    if any(p < 1 for p in ranks) or any(seq < 1 for seq in lengths):
        raise ValueError(f"every P and every L must be >= 1, got P {ranks}, L {lengths}")
    pool_sizes = sorted({p for p in ranks if p > 1}) or [1]
    bad_len = [(seq, p) for p in pool_sizes for seq in lengths if seq % (2 * p)]
    if bad_len:
        seq, p = bad_len[0]
        raise ValueError(f"L = {seq} is not divisible by 2*P = {2 * p} (zigzag sharding); every L must be")
    bad_docs = [(seq, p) for p in pool_sizes for seq in lengths if docs and seq % (docs * 2 * p)]
    if docs and batch != 1:
        raise ValueError(f"--docs packs the documents of one sequence: it needs batch 1, got {batch}")
    if docs < 0 or bad_docs:
        raise ValueError(f"--docs {docs}: every L must split into docs documents whose length is divisible by 2*P; "
                         f"got (L, P) = {bad_docs[:1]}")
    windows = {seq: window_tokens(window, seq) for seq in lengths}
    points = []
    for p in pool_sizes:
        threads = max(1, cores // p)
        p_impls = [i for i in impls if i == "single" or p > 1]
        if "ulysses" in p_impls and heads_kv % p:
            progress(f"skip ulysses P={p}: heads_kv={heads_kv} not divisible by P")
            p_impls.remove("ulysses")
        if "a2a" in p_impls and heads % p:
            progress(f"skip a2a P={p}: heads={heads} not divisible by P")
            p_impls.remove("a2a")
        if "a2a+p2p" in p_impls and (p % a2a_size or heads % a2a_size or p == a2a_size or a2a_size == 1):
            progress(f"skip a2a+p2p P={p}: needs a2a size {a2a_size} dividing P and heads, 1 < {a2a_size} < P")
            p_impls.remove("a2a+p2p")
        with borrow_pool(pools, p, threads, timeout_s) as pool:
            for mode in modes:
                for causal in causals:
                    for seq in lengths:
                        variants = [("", 0)] + ([("window", windows[seq])] if windows[seq] else []) + (
                            [("packed", 0), ("separate", 0)] if docs else []) + (
                            [("contiguous", 0)] if a2a_contiguous else []) + ([("dilated", 0)] if dilation else [])
                        cfgs = [dict(impl=impl, mode=mode, causal=causal, L=seq, batch=batch, heads=heads,
                                     heads_kv=heads_kv, head_dim=head_dim, dtype=dtype, threads=threads,
                                     backend=backend, seed=seed, device="cpu", own_session=own_sessions,
                                     variant=variant, window=w, docs=docs, a2a_size=a2a_size, dilation=dilation)
                                for impl in p_impls for variant, w in variants
                                if not variant or impl in VARIANT_IMPLS[variant]]
                        per_rank = pool.run(bench_worker, cfgs, repeats, warmup)
                        for i, cfg in enumerate(cfgs):
                            point = summarize(cfg, [r[i] for r in per_rank], p)
                            points.append(point)
                            progress(f"{cfg['impl']:10s} {point['variant']:20s} {mode:7s} causal={causal!s:5s} L={seq:6d} "
                                     f"P={point['P']:2d} (pool {p}) median {point['median_s'] * 1e3:9.2f} ms")
    add_efficiency(points, cores)
    return points


def window_tokens(window: str | int | None, seq: int) -> int:
    """``--window`` for a sequence of ``seq`` tokens: an int, or ``"L/k"`` for ``seq // k``; 0 = none."""
    if window is None:
        return 0
    text = str(window)
    try:
        tokens = seq // int(text[2:]) if text.startswith("L/") else int(text)
    except (ValueError, ZeroDivisionError):
        tokens = -1
    if tokens < 1:
        raise ValueError(f"--window must be a positive number of tokens or 'L/k', got {window!r}")
    return tokens


def dilation_pairs(text: str) -> list[tuple[int, int]]:
    """``--dilation w:r,w:r,...`` as pairs of positive ints."""
    try:
        pairs = [tuple(int(x) for x in item.split(":")) for item in text.split(",")]
    except ValueError:
        pairs = []
    if not pairs or any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise argparse.ArgumentTypeError(f"--dilation must be pairs w:r of positive ints, e.g. 2048:1,4096:2; got {text!r}")
    return pairs  # type: ignore[return-value]


@contextmanager
def borrow_pool(pools: Callable[[int, int], Any] | None, size: int, threads: int, timeout_s: float) -> Iterator[Any]:
    """A pool of ``size`` ranks: borrowed from ``pools`` (left open) or started and closed here."""
    from megatron_ring.runtime.pool import GlooPool

    if pools is not None:
        yield pools(size, threads)
        return
    with GlooPool(size, timeout_s=timeout_s, threads=threads) as pool:
        yield pool


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="megatron-ring bench attention", description=__doc__.split("\n")[0])
    ap.add_argument("--L", dest="lengths", type=positive_int, nargs="+", default=[1024, 2048, 4096, 8192],
                    help="global sequence lengths (divisible by 2*P)")
    ap.add_argument("--P", dest="ranks", type=positive_int, nargs="+", default=[2, 4], help="ring sizes (processes)")
    ap.add_argument("--impl", nargs="+", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--mode", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--causal", choices=["yes", "no", "both"], default="both")
    ap.add_argument("--batch", type=positive_int, default=1)
    ap.add_argument("--heads", type=positive_int, default=8)
    ap.add_argument("--heads-kv", type=non_negative_int, default=0, help="K/V heads (default 0 = heads)")
    ap.add_argument("--head-dim", type=positive_int, default=64)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--backend", default="auto", help="ring block backend (auto, math, sdpa, flash_attn)")
    ap.add_argument("--a2a-size", type=positive_int, default=2, help="a2a group size of a2a+p2p (1 < size < P)")
    ap.add_argument("--repeats", type=positive_int, default=5)
    ap.add_argument("--warmup", type=non_negative_int, default=1)
    ap.add_argument("--timeout", type=positive_float, default=600.0,
                    help="seconds per point before a rank is declared hung")
    ap.add_argument("--window", default=None,
                    help="also run the ring with a sliding window of W tokens (an int, or L/k), see the docstring")
    ap.add_argument("--docs", type=non_negative_int, default=0,
                    help="also run N equal documents, packed (cu_seqlens) and one by one")
    ap.add_argument("--a2a-contiguous", action="store_true",
                    help="also run a2a on contiguous shards (the layout Ulysses is given), see the docstring")
    ap.add_argument("--dilation", type=dilation_pairs, default=None,
                    help="also run the ring with LongNet's dilated attention, pairs w:r (e.g. 2048:1,4096:2)")
    ap.add_argument("--out", default="results/bench_attention.json", help="JSON output")
    ap.add_argument("--plots", default=None, help="directory for PNG plots (default: next to --out)")
    ap.add_argument("--no-plots", action="store_true")
    return ap


def bench_attention_main(argv: list[str] | None = None) -> int:
    """``megatron-ring bench attention``: run the sweep, write JSON, print the table, draw the plots."""
    parser = _parser()
    args = parser.parse_args(argv)
    causals = {"yes": [True], "no": [False], "both": [True, False]}[args.causal]
    machine_before = machine_description()
    try:
        points = run_sweep(lengths=args.lengths, ranks=args.ranks, impls=args.impl, modes=args.mode, causals=causals,
                           batch=args.batch, heads=args.heads, heads_kv=args.heads_kv or args.heads,
                           head_dim=args.head_dim, dtype=args.dtype, repeats=args.repeats, warmup=args.warmup,
                           backend=args.backend, timeout_s=args.timeout, window=args.window, docs=args.docs,
                           a2a_size=args.a2a_size, a2a_contiguous=args.a2a_contiguous, dilation=args.dilation)
    except ValueError as err:
        return usage_error(parser.prog, err)
    plain = args.window is None and not args.docs and not args.dilation  # the plots compare implementations, not variants
    write_outputs(points, machine_before, out=Path(args.out), argv=argv,
                  plots=None if args.no_plots or not plain else Path(args.plots) if args.plots
                  else Path(args.out).parent / "plots", a2a_size=args.a2a_size)
    return 0


def write_outputs(points: list[dict[str, Any]], machine: dict[str, Any], *, out: Path, argv: list[str] | None,
                  plots: Path | None, a2a_size: int = 2) -> dict[str, Any]:
    """Write the JSON, print the table, draw the plots (``plots=None``: none); returns the JSON object."""
    from megatron_ring.perf import report

    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine, "loadavg_after": list(os.getloadavg()), "argv": argv or [], "points": points,
              "bytes_per_rank_per_layer": [dict(zip(("L", "P", "comm", "fwd", "fwd_bwd"), row))
                                           for row in bytes_rows(points, a2a_size)]}
    out.write_text(json.dumps(result, indent=2))
    first = points[0] if points else {}
    report.print_table(f"attention bench ({machine['cpu']}, {machine['cores']} cores, {first.get('dtype')}, batch "
                       f"{first.get('batch')}, heads {first.get('heads')}/{first.get('heads_kv')}, head_dim "
                       f"{first.get('head_dim')})", report.BENCH_COLUMNS, report.bench_rows(points))
    report.print_table("bytes sent per rank per layer (formulas)", ["L", "P", "comm", "fwd", "fwd+bwd"],
                       bytes_rows(points, a2a_size))
    print(f"wrote {out}")
    if plots is not None:
        for path in report.plot_attention([p for p in points if not p.get("variant")], plots):
            print(f"wrote {path}")
    return result
