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
(:func:`megatron_ring.attention.transport.ring_stats`) / wall time (for all-gather, forward only:
the share of the call outside the block kernels); bytes sent per rank per call (forward, from the
instrumentation; for Ulysses computed from the four all-to-alls; ``bytes_sent`` is rank 0's,
``bytes_sent_max`` the largest over ranks, which differ under a window); peak memory per rank
(Note [Peak memory on CPU] in harness.py; each worker in its own session, Note [Ranks and the
scheduler]). A second table gives the bytes every comm sends per rank per layer at each (L, P),
from the formulas of costs/traffic.py
(:func:`~megatron_ring.perf.bench.attention_report.comm_bytes`), so comms that were not run can
be compared too.

The ranks' side is :mod:`~megatron_ring.perf.bench.attention_worker`, the tables and plots
:mod:`~megatron_ring.perf.bench.attention_report`.

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
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

from megatron_ring.attention.comms import A2A_COMMS
from megatron_ring.perf.bench import attention_report
from megatron_ring.perf.bench.attention_worker import IMPLS, MODES, VARIANT_IMPLS, bench_worker, ulysses_available
from megatron_ring.perf.bench.harness import CAUSAL, DTYPES, borrow_pool, machine_description, slowest
from megatron_ring.perf.report import print_table
from megatron_ring.config import output_problem
from megatron_ring.runtime.args import non_negative_int, positive_float, positive_int, usage_error
from megatron_ring.runtime.job import Interrupted, interruptible
from megatron_ring.runtime.reporting import write_json_atomic


def summarize(cfg: dict[str, Any], per_rank: list[dict[str, Any]], size: int) -> dict[str, Any]:
    """One JSON point from every rank's :func:`bench_worker` result for ``cfg`` (idle ranks ignored)."""
    active = [r for r in per_rank if r["active"]]
    wall = slowest([r["times"] for r in active])
    timed = sum(sum(r["times"]) for r in active)
    ranks = len(active)
    if cfg["impl"] in ("ring_p2p", *A2A_COMMS):
        exposed: float | None = sum(r["wait_s"] for r in active) / timed if ranks > 1 else 0.0
    elif cfg["impl"] == "all_gather" and cfg["mode"] == "fwd":
        ring_total = sum(r["ring_total_s"] for r in active)
        exposed = 1 - sum(r["compute_s"] for r in active) / ring_total if ring_total else None
    else:
        exposed = None
    sent = active[0]["bytes_sent"] if cfg["impl"] != "ulysses" else attention_report.ulysses_bytes(
        L=cfg["L"], P=size, batch=cfg["batch"], heads=cfg["heads"], heads_kv=cfg["heads_kv"],
        head_dim=cfg["head_dim"], dtype=cfg["dtype"], mode=cfg["mode"])
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


def run_attention_bench(*, lengths: list[int], ranks: list[int], impls: list[str], modes: list[str],
                        causals: list[bool], batch: int, heads: int, heads_kv: int, head_dim: int, dtype: str,
                        repeats: int, warmup: int, backend: str, seed: int = 0, timeout_s: float = 600.0,
                        a2a_size: int = 2, progress: Callable[[str], None] = print,
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


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="megatron-ring bench attention", description=__doc__.split("\n")[0])
    ap.add_argument("--L", dest="lengths", type=positive_int, nargs="+", default=[1024, 2048, 4096, 8192],
                    help="global sequence lengths (divisible by 2*P)")
    ap.add_argument("--P", dest="ranks", type=positive_int, nargs="+", default=[2, 4], help="ring sizes (processes)")
    ap.add_argument("--impl", nargs="+", default=list(IMPLS), choices=IMPLS)
    ap.add_argument("--mode", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--causal", choices=list(CAUSAL), default="both")
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
    problem = output_problem({"--out": (args.out, False), "--plots": (None if args.no_plots else args.plots, True)})
    if problem is not None:
        return usage_error(parser.prog, problem)
    causals = CAUSAL[args.causal]
    machine_before = machine_description()
    try:
        with interruptible():
            points = run_attention_bench(lengths=args.lengths, ranks=args.ranks, impls=args.impl, modes=args.mode,
                                         causals=causals, batch=args.batch, heads=args.heads,
                                         heads_kv=args.heads_kv or args.heads, head_dim=args.head_dim, dtype=args.dtype,
                                         repeats=args.repeats, warmup=args.warmup, backend=args.backend,
                                         timeout_s=args.timeout, window=args.window, docs=args.docs,
                                         a2a_size=args.a2a_size, a2a_contiguous=args.a2a_contiguous,
                                         dilation=args.dilation)
    except ValueError as err:
        return usage_error(parser.prog, err)
    except Interrupted as stop:
        print(f"[bench] {stop}: the ranks were stopped; nothing written", file=sys.stderr)
        return stop.exit_code
    plain = args.window is None and not args.docs and not args.dilation  # the plots compare implementations, not variants
    write_attention_bench(points, machine_before, out=Path(args.out), argv=argv,
                          plots=None if args.no_plots or not plain else Path(args.plots) if args.plots
                          else Path(args.out).parent / "plots", a2a_size=args.a2a_size)
    return 0


def write_attention_bench(points: list[dict[str, Any]], machine: dict[str, Any], *, out: Path,
                          argv: list[str] | None, plots: Path | None, a2a_size: int = 2) -> dict[str, Any]:
    """Write the JSON, print the table, draw the plots (``plots=None``: none); returns the JSON object."""
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine, "loadavg_after": list(os.getloadavg()), "argv": argv or [], "points": points,
              "bytes_per_rank_per_layer": [dict(zip(("L", "P", "comm", "fwd", "fwd_bwd"), row))
                                           for row in attention_report.bytes_rows(points, a2a_size)]}
    write_json_atomic(out, result)
    first = points[0] if points else {}
    print_table(f"attention bench ({machine['cpu']}, {machine['cores']} cores, {first.get('dtype')}, batch "
                f"{first.get('batch')}, heads {first.get('heads')}/{first.get('heads_kv')}, head_dim "
                f"{first.get('head_dim')})", attention_report.BENCH_COLUMNS, attention_report.bench_rows(points))
    print_table("bytes sent per rank per layer (formulas)", attention_report.BYTES_COLUMNS,
                attention_report.bytes_rows(points, a2a_size))
    print(f"wrote {out}")
    if plots is not None:
        for path in attention_report.plot_attention([p for p in points if not p.get("variant")], plots):
            print(f"wrote {path}")
    return result
