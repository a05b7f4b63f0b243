"""The planner's CP comm choice as a figure: predicted attention time of each comm against the prompt length.

``megatron-ring plan <config> --comm-figure out.png`` draws, for the config's model and CP size
and for half that CP size (one node) beside it, the forward attention time per layer the cost
model predicts for each comm of :data:`~megatron_ring.attention.comms.COMMS` (Note [All-to-all in
the cost model] in costs/comm_choice.py), and shades the comm ``comm="auto"`` picks at each length.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from megatron_ring.parallel.layout import ParallelLayout
from megatron_ring.attention.comms import COMMS
from megatron_ring.perf.planner.cost_model import Planner
from megatron_ring.perf.planner.inputs import PlanInput

COLORS = dict(zip(COMMS, ("tab:blue", "tab:gray", "tab:orange", "tab:green")))
"""Each comm's colour, in the order of ``COMMS``."""


def comm_curves(planner: Planner, base: PlanInput, lengths: list[int]) -> dict[str, list[float]]:
    """``{comm: [seconds per layer forward at each length]}`` (``inf`` where a comm cannot run) and
    ``"auto"``: the index into COMMS of the comm auto picks."""
    curves: dict[str, list[float]] = {c: [] for c in COMMS}
    picks: list[float] = []
    for length in lengths:
        step = planner.ring_step(replace(base, workload=replace(base.workload, prompt_len=length)))
        for comm in COMMS:
            curves[comm].append(step.comm_times[comm])
        picks.append(float(COMMS.index(min(COMMS, key=lambda c: step.comm_times[c]))))
    curves["auto"] = picks
    return curves


def draw_comm_figure(planner: Planner, base: PlanInput, path: str | Path) -> Path:
    """Two panels (the config's cp, and cp / 2 when it spans more than one node), time per layer vs L."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cps = [base.layout.cp] + ([base.layout.cp // 2] if base.layout.cp >= 4 else [])
    fig, axes = plt.subplots(1, len(cps), figsize=(6 * len(cps), 4.2), squeeze=False)
    hw = planner.hw
    for ax, cp in zip(axes[0], reversed(cps)):
        layout = ParallelLayout(tp=base.layout.tp, cp=cp)
        lengths = [n for n in (2 ** k for k in range(11, 22)) if n % (2 * cp) == 0 and n >= 4 * cp]
        plan = replace(base, layout=layout)
        curves = comm_curves(planner, plan, lengths)
        for comm in COMMS:
            pts = [(n, t * 1e3) for n, t in zip(lengths, curves[comm]) if t != float("inf")]
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3, color=COLORS[comm], label=comm)
        for n, pick in zip(lengths, curves["auto"]):
            ax.axvspan(n / 2 ** 0.5, n * 2 ** 0.5, color=COLORS[COMMS[int(pick)]], alpha=0.08, lw=0)
        nodes = -(-cp * base.layout.tp // hw.devices_per_node)
        m = base.model
        ax.set_title(f"cp={cp} ({nodes} node{'s' if nodes > 1 else ''} of {hw.devices_per_node}), "
                     f"a2a group {planner.a2a_size(plan)}\nH={m.num_heads // base.layout.tp} H_kv="
                     f"{max(1, m.num_kv_heads // base.layout.tp)} d_h={m.head_dim} {base.dtype} "
                     f"{'causal' if base.causal else 'full'}, {hw.name}", fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt length L (shaded: comm='auto' picks)")
        ax.set_ylabel("attention forward per layer (ms)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
