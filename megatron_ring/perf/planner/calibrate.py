"""``megatron-ring calibrate``: measure this machine (CPU ranks joined by gloo) and write a hardware profile.

What it measures, on ``--ranks`` gloo processes started by
:class:`~megatron_ring.runtime.pool.GlooPool` with ``cores // ranks`` threads each (as the
inference ranks run), every rank at once after a barrier:

* fp32 and bf16 GEMM FLOP/s -> ``peak_flops`` (per core: a rank's FLOP/s / its threads), with
  ``matmul_efficiency = 1`` (the peak *is* the achieved number);
* the ring's block kernel (``block_forward``, backend ``"sdpa"``: torch's CPU flash kernel),
  causal and not -> ``attention_efficiency`` = its FLOP/s / the GEMM's, fp32;
* a large copy -> ``hbm_bytes_per_s`` (the machine's: the ranks' bandwidths summed);
* between ranks: p2p (isend/irecv ping-pong), all-reduce and all-gather over several message
  sizes, each fitted to latency + size / bandwidth (Note [Calibration fits]);
* the fixed host cost of a real Megatron transformer layer and of the rest of a forward pass
  (``layer_overhead_s``, ``step_overhead_s``), which dominate tiny CPU models.

Output: the profile JSON (``--out``, loadable by ``megatron-ring plan --hardware``) and a side
JSON ``<out>.raw.json`` with every measurement, the fits, and the machine with its load average
before and after (numbers measured on a busy machine are that machine's share, not its speed).

CPU only: on a GPU machine it still measures the CPU and gloo; GPU numbers (NCCL bandwidths,
cuDNN attention) need one GPU per rank and are not measured here.

Note [Calibration fits]
~~~~~~~~~~~~~~~~~~~~~~~
Every point is the median over ``repeats`` of the slowest rank's time; a communication repeat
times ``calls`` calls back to back (after one barrier) and divides, so the skew with which ranks
leave the barrier is not charged to a small message. A collective moving ``n`` bytes is fitted to
``t = alpha + x / beta`` over the message sizes by least squares in *relative* error (weights
``1 / t^2``): sizes span 1 KB to 32 MB, and a plain fit lets the largest messages decide the
intercept, the latency that small messages (decode's collectives) actually pay. It uses
``x = n`` for p2p (one way: half a ping-pong), ``x = 2 (P-1)/P n`` for an all-reduce of an
``n``-byte buffer and ``x = (P-1) n`` for an all-gather of ``n`` bytes per rank (the cost
model's formulas, ``HardwareProfile.collective_s``): ``alpha`` is the latency, ``beta`` the
bandwidth. The host overhead is fitted the same way: one forward of a tiny Megatron GPT
(d = 64, one token, batch 1: compute is negligible) through ``k`` of its layers,
``t = a + b k``; ``b`` -> ``layer_overhead_s``, ``a`` -> ``step_overhead_s``. A negative
intercept (noise) is clamped to 0; a non-positive slope (size made no difference over the sizes
tried) gives latency = the smallest time and bandwidth = the largest point's ``x / t`` (a lower
bound); both are flagged (``"clamped"``) in the raw JSON, as is ``r2`` of every fit.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_ring.costs.comm_choice import attention_flops
from megatron_ring.perf.bench import harness
from megatron_ring.perf.report import fmt_bytes, fmt_time, print_table
from megatron_ring.config import output_problem
from megatron_ring.runtime.args import int_at_least, positive_float, usage_error
from megatron_ring.runtime.job import Interrupted, interruptible

DTYPES: dict[str, torch.dtype] = {name: harness.DTYPES[name] for name in ("fp32", "bf16")}
"""The dtypes measured: fp32 and bf16 GEMMs and attention."""
FULL: dict[str, Any] = {"matmul_n": {"fp32": 1024, "bf16": 512}, "attention": (1, 8, 2048, 64),
                        "copy_bytes": 256 << 20, "message_bytes": [1 << 10, 16 << 10, 256 << 10, 4 << 20, 32 << 20],
                        "layers": [1, 2, 4], "repeats": 5, "warmup": 1, "calls": 8}
QUICK: dict[str, Any] = {"matmul_n": {"fp32": 64, "bf16": 32}, "attention": (1, 2, 64, 16),
                         "copy_bytes": 1 << 20, "message_bytes": [1 << 10, 16 << 10, 64 << 10],
                         "layers": [1, 2], "repeats": 3, "warmup": 1, "calls": 2}
TINY_GPT: dict[str, Any] = {
    "name": "calibrate-overhead", "dtype": "fp32", "attention": "local", "parallel": {"tp": 1, "pp": 1, "cp": 1},
    "model": {"num_layers": 4, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 256,
              "vocab_size": 128, "seq_length": 64, "position_embedding": "rope"},
}


# ---------------------------------------------------------------------------------------------
# worker side (every rank of the pool)


def _times(fn: Callable[[], Any], repeats: int, warmup: int, calls: int = 1) -> list[float]:
    """Wall time of one ``fn`` per repeat on this rank, all ranks starting together; each repeat
    times ``calls`` calls back to back and divides (Note [Calibration fits])."""
    for _ in range(warmup):
        fn()
    return [harness.barrier_timed(fn, calls) for _ in range(repeats)]


def compute_worker(sizes: dict[str, Any]) -> dict[str, Any]:
    """GEMM, block-attention and copy times of this rank (seconds per repeat) and the work they did."""
    from megatron_ring.attention.block import block_forward

    reps, warm = sizes["repeats"], sizes["warmup"]
    out: dict[str, Any] = {"threads": torch.get_num_threads(), "matmul": {}, "attention": {}}
    for name, n in sizes["matmul_n"].items():
        a = torch.randn(n, n, dtype=DTYPES[name])
        b = torch.randn(n, n, dtype=DTYPES[name])
        out["matmul"][name] = {"flops": 2.0 * n ** 3, "times_s": _times(lambda: a @ b, reps, warm)}
    batch, heads, seq, dim = sizes["attention"]
    for name, dtype in DTYPES.items():
        q, k, v = (torch.randn(batch, heads, seq, dim, dtype=dtype) for _ in range(3))
        for causal in (True, False):
            def call() -> None:
                block_forward(q, k, v, causal=causal, scale=dim ** -0.5, backend="sdpa")
            flops = attention_flops(batch=batch, q_len=seq, k_len=seq, heads=heads, head_dim=dim, causal=causal)
            out["attention"][f"{name}_{'causal' if causal else 'full'}"] = {
                "flops": flops, "times_s": _times(call, reps, warm)}
    src = torch.ones(sizes["copy_bytes"] // 4)
    dst = torch.empty_like(src)
    out["copy"] = {"bytes": 2.0 * sizes["copy_bytes"], "times_s": _times(lambda: dst.copy_(src), reps, warm)}
    return out


def comm_worker(sizes: dict[str, Any]) -> dict[str, dict[int, list[float]]]:
    """Times of p2p (ranks 0 and 1, one way), all-reduce and all-gather per message size, this rank."""
    from megatron_ring.attention.gather import start_gather_blocks

    rank, world = dist.get_rank(), dist.get_world_size()
    reps, warm = sizes["repeats"], sizes["warmup"]
    out: dict[str, dict[int, list[float]]] = {"p2p": {}, "all_reduce": {}, "all_gather": {}}
    for nbytes in sizes["message_bytes"]:
        buf = torch.ones(nbytes // 4)

        def ping_pong() -> None:
            if rank == 0:
                dist.isend(buf, 1).wait()
                dist.irecv(buf, 1).wait()
            elif rank == 1:
                dist.irecv(buf, 0).wait()
                dist.isend(buf, 0).wait()

        calls = sizes["calls"]
        out["p2p"][nbytes] = [t / 2 for t in _times(ping_pong, reps, warm, calls)] if rank < 2 else []
        out["all_reduce"][nbytes] = _times(lambda: dist.all_reduce(buf), reps, warm, calls)
        out["all_gather"][nbytes] = _times(lambda: start_gather_blocks((buf,), None, rank, world).wait(), reps, warm, calls)
    return out


def overhead_worker(sizes: dict[str, Any]) -> dict[int, list[float]] | str:
    """Times of one forward of a tiny Megatron GPT through ``k`` layers, per ``k``; a reason string
    when megatron-core is not installed."""
    try:
        from megatron_ring.integrations.megatron.model import build_gpt_model, unwrap
        from megatron_ring.integrations.megatron.state import init_megatron
    except ImportError as err:
        return f"megatron-core is not importable ({err})"
    from megatron_ring.config.gpt import GPTConfig
    from megatron_ring.parallel.layout import ParallelLayout

    cfg = GPTConfig.parse(TINY_GPT, where="calibrate's overhead model")
    init_megatron(ParallelLayout(dp=dist.get_world_size()), device=torch.device("cpu"))
    model = unwrap(build_gpt_model(cfg)).eval()
    ids = torch.zeros(1, 1, dtype=torch.int64)
    positions = torch.zeros(1, dtype=torch.int64)
    rope = model.rotary_pos_emb.get_emb(cfg.model.seq_length)[positions]

    @torch.no_grad()
    def forward(layers: int) -> None:
        hidden = model.embedding(input_ids=ids, position_ids=positions[None])
        for layer in model.decoder.layers[:layers]:
            hidden, _ = layer(hidden, attention_mask=None, rotary_pos_emb=rope)
        logits, _ = model.output_layer(model.decoder.final_layernorm(hidden))
        logits[-1].argmax(dim=-1)

    return {k: _times(lambda: forward(k), sizes["repeats"], sizes["warmup"]) for k in sizes["layers"]}


# ---------------------------------------------------------------------------------------------
# driver


def fit_line(xs: list[float], ts: list[float]) -> dict[str, Any]:
    """Least squares ``t = alpha + x / beta`` in relative error (weights ``1 / t^2``, Note [Calibration
    fits]): alpha, beta, r2 (of the weighted fit), clamped."""
    n = len(xs)
    ws = [1.0 / t ** 2 if t > 0 else 1.0 for t in ts]
    sw = sum(ws)
    mx, mt = sum(w * x for w, x in zip(ws, xs)) / sw, sum(w * t for w, t in zip(ws, ts)) / sw
    sxx = sum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    slope = sum(w * (x - mx) * (t - mt) for w, x, t in zip(ws, xs, ts)) / sxx if sxx > 0 else 0.0
    alpha = mt - slope * mx
    clamped = []
    if slope <= 0:  # size made no difference here: latency only; bandwidth at least x / t of the largest point
        i = max(range(n), key=lambda j: xs[j])
        slope, alpha = ts[i] / xs[i], min(ts)
        clamped.append("slope")
    elif alpha < 0:
        alpha = 0.0
        clamped.append("alpha")
    sst = sum(w * (t - mt) ** 2 for w, t in zip(ws, ts))
    sse = sum(w * (t - alpha - slope * x) ** 2 for w, x, t in zip(ws, xs, ts))
    return {"alpha": alpha, "beta": 1.0 / slope, "r2": 1.0 - sse / sst if sst > 0 else 1.0, "clamped": clamped,
            "x": xs, "t": ts}


def _rate(per_rank: list[dict[str, Any]], key: str, name: str) -> list[float]:
    """Work per second of each rank (its median time)."""
    return [r[key][name]["flops"] / statistics.median(r[key][name]["times_s"]) for r in per_rank]


def summarize(compute: list[dict[str, Any]], comm: list[dict[str, Any]], overhead: list[Any], ranks: int,
              cores: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(profile fields, raw measurements and fits) from every rank's worker results."""
    threads = compute[0]["threads"]
    matmul = {name: statistics.median(_rate(compute, "matmul", name)) for name in compute[0]["matmul"]}
    attention = {name: statistics.median(_rate(compute, "attention", name)) for name in compute[0]["attention"]}
    copy = sum(r["copy"]["bytes"] / statistics.median(r["copy"]["times_s"]) for r in compute)
    ratio = statistics.mean(attention[f"fp32_{c}"] for c in ("causal", "full")) / matmul["fp32"]
    factors = {"p2p": lambda n: n, "all_reduce": lambda n: 2.0 * (ranks - 1) / ranks * n,
               "all_gather": lambda n: (ranks - 1) * n}
    fits = {}
    for kind, scale in factors.items():
        sizes = sorted(comm[0][kind])
        fits[kind] = fit_line([scale(n) for n in sizes],
                              [harness.slowest_median([r[kind][n] for r in comm]) for n in sizes])
    fields: dict[str, Any] = {
        "peak_flops": {name: rate / threads for name, rate in matmul.items()},
        "matmul_efficiency": 1.0, "attention_efficiency": min(1.0, ratio), "hbm_bytes_per_s": copy,
        "hbm_efficiency": 1.0, "intra_node_bytes_per_s": fits["p2p"]["beta"],
        "inter_node_bytes_per_s": fits["p2p"]["beta"], "link_efficiency": 1.0,
        "p2p_latency_s": fits["p2p"]["alpha"], "collective_latency_s": fits["all_reduce"]["alpha"],
        "allreduce_bytes_per_s": fits["all_reduce"]["beta"], "allgather_bytes_per_s": fits["all_gather"]["beta"],
        "allgather_latency_s": fits["all_gather"]["alpha"], "cpu_cores": cores,
    }
    raw: dict[str, Any] = {"threads_per_rank": threads, "matmul_flops_per_rank": matmul,
                           "attention_flops_per_rank": attention, "attention_over_matmul_fp32": ratio,
                           "copy_bytes_per_s_all_ranks": copy, "fits": fits}
    if isinstance(overhead[0], str):
        raw["overhead"] = {"skipped": overhead[0]}
    else:
        layers = sorted(overhead[0])
        fit = fit_line([float(k) for k in layers], [harness.slowest_median([r[k] for r in overhead]) for k in layers])
        fields["layer_overhead_s"], fields["step_overhead_s"] = 1.0 / fit["beta"], fit["alpha"]
        raw["overhead"] = fit
    return fields, raw


def calibrate(*, ranks: int = 2, quick: bool = False, pool: Any = None, timeout_s: float = 600.0,
              progress: Callable[[str], None] = print) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run the measurements on ``ranks`` gloo ranks (``pool``: a running GlooPool to borrow, left open).

    Returns (profile fields, raw measurements); see :func:`summarize`.
    """
    from megatron_ring.runtime.pool import GlooPool

    if ranks < 2:
        raise ValueError(f"--ranks must be >= 2 (communication needs two ranks), got {ranks}")
    sizes = QUICK if quick else FULL
    cores = os.cpu_count() or 1
    own = pool is None
    pool = pool or GlooPool(ranks, timeout_s=timeout_s, threads=max(1, cores // ranks))
    try:
        if pool.world_size != ranks:
            raise ValueError(f"the pool has {pool.world_size} ranks, not {ranks}")
        progress(f"calibrate: compute and memory on {ranks} ranks x {max(1, cores // ranks)} threads")
        compute = pool.run(compute_worker, sizes)
        progress("calibrate: p2p, all-reduce, all-gather")
        comm = pool.run(comm_worker, sizes)
        progress("calibrate: host overhead of a Megatron layer")
        overhead = pool.run(overhead_worker, sizes)
    finally:
        if own:
            pool.close()
    fields, raw = summarize(compute, comm, overhead, ranks, cores)
    raw["sizes"] = {k: list(v) if isinstance(v, tuple) else v for k, v in sizes.items()}
    return fields, raw


def build_profile(fields: dict[str, Any], *, name: str, machine: dict[str, Any], memory_bytes: float) -> dict[str, Any]:
    """A HardwareProfile mapping (validated by the caller) from the measured fields."""
    desc = (f"Calibrated by megatron-ring calibrate on {machine['cpu']} ({machine['cores']} cores, torch "
            f"{machine['torch']}), {fields['cpu_cores']} cores shared by the ranks, gloo on loopback; load average "
            f"{machine['loadavg_1_5_15'][0]:.2f} before. Raw numbers and fits in the side .raw.json")
    return {"name": name, "description": desc, "memory_bytes": memory_bytes, "usable_memory_fraction": 0.8,
            "devices_per_node": 1024, **fields}


def _memory_bytes() -> float:
    """Physical memory of this machine."""
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _table(fields: dict[str, Any], raw: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    fits = raw["fits"]
    rows = [[f"GEMM {k} (per core)", f"{v / 1e9:.3g} GFLOP/s", ""] for k, v in fields["peak_flops"].items()]
    rows += [[f"block attention {k} (per rank)", f"{v / 1e9:.3g} GFLOP/s", ""]
             for k, v in raw["attention_flops_per_rank"].items()]
    rows.append(["attention_efficiency", f"{fields['attention_efficiency']:.3g}",
                 f"fp32 attention / GEMM = {raw['attention_over_matmul_fp32']:.3g}"])
    rows.append(["memory copy (all ranks)", f"{fmt_bytes(fields['hbm_bytes_per_s'])}/s", ""])
    for kind, fit in fits.items():
        rows.append([f"{kind}: latency + x / bandwidth", f"{fmt_time(fit['alpha'])} + x / {fmt_bytes(fit['beta'])}/s",
                     f"r2 {fit['r2']:.3f}" + (f", clamped {fit['clamped']}" if fit["clamped"] else "")])
    over = raw["overhead"]
    if "skipped" in over:
        rows.append(["host overhead", "not measured", over["skipped"]])
    else:
        rows.append(["host overhead: per pass + per layer", f"{fmt_time(over['alpha'])} + "
                     f"{fmt_time(1 / over['beta'])} x layers", f"r2 {over['r2']:.3f}"
                     + (f", clamped {over['clamped']}" if over["clamped"] else "")])
    return ["quantity", "value", "fit"], rows


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="megatron-ring calibrate", description=__doc__.split("\n")[0].strip("`"))
    ap.add_argument("--out", default="results/calibrated-profile.json", help="profile JSON (raw: <out>.raw.json)")
    ap.add_argument("--name", default="calibrated", help="profile name")
    ap.add_argument("--ranks", type=int_at_least(2), default=2,
                    help="gloo ranks, >= 2: communication needs two (default 2)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 3 repeats: checks plumbing, not the machine")
    ap.add_argument("--timeout", type=positive_float, default=600.0, help="seconds before a rank is declared hung")
    return ap


def calibrate_main(argv: list[str] | None = None) -> int:
    """``megatron-ring calibrate``: measure, write the profile and the raw JSON, print the table."""
    from megatron_ring.perf.planner.hardware import HardwareProfile
    from megatron_ring.runtime.reporting import write_json_atomic

    parser = _parser()
    args = parser.parse_args(argv)
    problem = output_problem({"--out": (args.out, False), "--out (raw)": (Path(args.out).with_suffix(".raw.json"), False)})
    if problem is not None:
        return usage_error(parser.prog, problem)
    machine = harness.machine_description()
    try:
        with interruptible():
            fields, raw = calibrate(ranks=args.ranks, quick=args.quick, timeout_s=args.timeout)
        profile = build_profile(fields, name=args.name, machine=machine, memory_bytes=_memory_bytes())
        HardwareProfile.parse(profile, where="the calibrated profile")
    except ValueError as err:  # ConfigError included
        return usage_error(parser.prog, err)
    except Interrupted as stop:
        print(f"[calibrate] {stop}: the ranks were stopped; nothing written", file=sys.stderr)
        return stop.exit_code
    out = Path(args.out)
    raw_path = out.with_suffix(".raw.json")
    write_json_atomic(out, profile)
    write_json_atomic(raw_path, {"machine": machine, "loadavg_after": list(os.getloadavg()), "ranks": args.ranks,
                                 "quick": args.quick, "argv": argv or [], **raw})
    print_table(f"calibrate: {machine['cpu']}, {args.ranks} ranks ({'quick' if args.quick else 'full'} sizes)",
                *_table(fields, raw))
    print(f"wrote {out} and {raw_path}")
    return 0
