"""``megatron-ring bench attention``'s tables and plots: measured points, bytes per comm from the formulas.

``matplotlib`` is optional (the ``bench`` extra): without it :func:`plot_attention` says so and
draws nothing.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from megatron_ring.attention.comms import A2A_COMMS, COMMS
from megatron_ring.costs.traffic import alltoall_bytes, bytes_sent
from megatron_ring.perf.bench.attention_worker import IMPLS, MODES
from megatron_ring.perf.bench.harness import DTYPES
from megatron_ring.perf.report import fmt_bytes, fmt_time


def ulysses_bytes(*, L: int, P: int, batch: int, heads: int, heads_kv: int, head_dim: int, dtype: str,
                  mode: str) -> float:
    """Bytes each rank sends in DeepSpeed Ulysses' all-to-alls (q, k, v out, the output back; again in
    backward): its K/V heads travel as they are (it fails with heads_kv % P != 0, counted as if it ran)."""
    passes = 2 if mode == "fwd_bwd" else 1
    return passes * alltoall_bytes(batch=batch, seq_local=L // P, heads_q=heads, heads_kv=heads_kv,
                                   head_dim=head_dim, element_size=DTYPES[dtype].itemsize, a2a_size=P)


def comm_bytes(*, L: int, P: int, batch: int, heads: int, heads_kv: int, head_dim: int, dtype: str,
               a2a_size: int) -> dict[str, dict[str, float]]:
    """Bytes each rank sends for one attention layer, ``{comm: {"fwd": .., "fwd_bwd": ..}}``: every comm
    (:func:`~megatron_ring.costs.traffic.bytes_sent`; an all-to-all comm only where its group divides
    P and the heads) and ``ulysses`` (:func:`ulysses_bytes`)."""
    shape = dict(batch=batch, seq_local=L // P, heads_q=heads, heads_kv=heads_kv, head_dim=head_dim,
                 element_size=DTYPES[dtype].itemsize, cp_size=P)
    out = {}
    for comm in COMMS:
        a2a = P if comm == "a2a" else a2a_size
        if comm in A2A_COMMS and (heads % a2a or P % a2a):
            continue
        fwd = bytes_sent(comm, **shape, a2a_size=a2a)
        out[comm] = {"fwd": fwd, "fwd_bwd": fwd + bytes_sent(comm, **shape, a2a_size=a2a, backward=True)}
    out["ulysses"] = {mode: ulysses_bytes(L=L, P=P, batch=batch, heads=heads, heads_kv=heads_kv, head_dim=head_dim,
                                          dtype=dtype, mode=mode) for mode in MODES}
    return out


BYTES_COLUMNS = ["L", "P", "comm", "fwd", "fwd+bwd"]


def bytes_rows(points: Sequence[dict[str, Any]], a2a_size: int) -> list[list[str]]:
    """One row per (L, P, comm) of the bench: bytes per rank per layer, forward and forward+backward."""
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


BENCH_COLUMNS = ["impl", "mode", "causal", "L", "P", "pool", "median", "min", "max", "eff", "eff/core",
                 "exposed %", "peak mem/rank", "bytes sent/rank"]


def bench_rows(points: Sequence[dict[str, Any]]) -> list[list[str]]:
    """Rows of the attention bench table."""
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}"

    def num(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    return [[p["impl"] + (f" {p['variant']}" if p.get("variant") else ""), p["mode"], "yes" if p["causal"] else "no", p["L"], p["P"], p.get("pool_P", p["P"]),
             fmt_time(p["median_s"]),
             fmt_time(p["min_s"]), fmt_time(p["max_s"]), num(p.get("efficiency")), num(p.get("efficiency_per_core")),
             pct(p.get("exposed_fraction")), fmt_bytes(p["peak_mem_bytes"]),
             "-" if p.get("bytes_sent") is None else fmt_bytes(p.get("bytes_sent_max", p["bytes_sent"]))]
            for p in points]


IMPL_COLORS = dict(zip(IMPLS, ("black", "tab:blue", "tab:orange", "tab:red", "tab:purple", "tab:green")))
"""Each implementation's colour, in the order of ``IMPLS``."""
POOL_STYLES = {1: "-", 2: "-", 4: "--", 8: ":", 16: "-."}


def plot_attention(points: Sequence[dict[str, Any]], out_dir: str | Path) -> list[Path]:
    """PNG plots, one panel per mode: time vs L, efficiency vs P, memory vs L.

    Colour = implementation, line style = pool size P, marker = causal (o) or not (s).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install 'megatron_ring[bench]')")
        return []
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    modes = sorted({p["mode"] for p in points}, reverse=True)
    written = []
    for name, x_key, y_key, line_keys, ylabel, logy in (
        ("time_vs_L.png", "L", "median_s", ("impl", "causal", "pool_P"), "median time per call (s)", True),
        ("efficiency_vs_P.png", "P", "efficiency", ("impl", "causal", "L"), "T_single / (P * T)", False),
        ("memory_vs_L.png", "L", "peak_mem_bytes", ("impl", "causal", "pool_P"), "peak memory per rank (bytes)", True),
    ):
        fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes), 5), squeeze=False)
        for ax, mode in zip(axes[0], modes):
            lines: dict[tuple[Any, ...], list[tuple[float, float]]] = {}
            for p in points:
                if p["mode"] != mode or p.get(y_key) is None or (y_key == "efficiency" and p["impl"] == "single"):
                    continue
                key = tuple(p.get(k, p["P"]) for k in line_keys)
                lines.setdefault(key, []).append((p[x_key], p[y_key]))
            for key, pts in sorted(lines.items(), key=str):
                impl, causal, third = key
                pts.sort()
                style = "-" if x_key == "P" else POOL_STYLES.get(third, "-")
                label = f"{impl} {'causal' if causal else 'full'} " + (f"L={third}" if x_key == "P" else f"pool P={third}")
                ax.plot([a for a, _ in pts], [b for _, b in pts], linestyle=style, marker="o" if causal else "s",
                        color=IMPL_COLORS.get(impl), label=label, alpha=0.5 + 0.5 * (x_key != "P"))
            ax.set_title(mode)
            ax.set_xlabel(x_key)
            ax.set_ylabel(ylabel)
            ax.set_xscale("log", base=2)
            if logy:
                ax.set_yscale("log")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=6)
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
