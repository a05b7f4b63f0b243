"""The bench commands end to end at tiny sizes: structure and correctness, never timings.

The sweeps borrow the session's gloo pools (``gloo_pool`` in conftest) so no test pays for
starting processes twice; the CLI entry points are covered on their argument errors.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from megatron_ring.attention.comms import COMMS
from megatron_ring.perf.bench.attention import bench_attention_main, run_attention_bench, write_attention_bench
from megatron_ring.perf.bench.attention_report import comm_bytes
from megatron_ring.perf.bench.attention_worker import ulysses_available
from megatron_ring.perf.bench.harness import machine_description
from megatron_ring.perf.bench.numerics import bench_numerics_main, numerics_rows, run_numerics
from megatron_ring.perf.planner.plan_cli import plan_main
from megatron_ring.perf.report import markdown_table


def _quiet(*_: Any) -> None:
    pass


def test_bench_attention_runs_the_all_to_all_comms(tmp_path: Path, gloo_pool: Any) -> None:
    points = run_attention_bench(lengths=[32], ranks=[4], impls=["ring_p2p", "a2a", "a2a+p2p", "ulysses"],
                                 modes=["fwd_bwd"], causals=[True], batch=1, heads=4, heads_kv=2, head_dim=8,
                                 dtype="fp32", repeats=1, warmup=1, backend="auto", progress=_quiet,
                                 pools=lambda size, threads: gloo_pool(size), own_sessions=False, a2a_size=2,
                                 a2a_contiguous=True)
    assert {(p["impl"], p["variant"]) for p in points} == {  # ulysses: heads_kv 2 % P 4
        ("ring_p2p", ""), ("a2a", ""), ("a2a", "contiguous"), ("a2a+p2p", "")}
    data = write_attention_bench(points, machine_description(), out=tmp_path / "b.json", argv=None, plots=None)
    table = {(r["comm"], r["P"]) for r in data["bytes_per_rank_per_layer"]}
    assert table == {(c, "4") for c in (*COMMS, "ulysses")}
    measured = {p["impl"]: p["bytes_sent"] for p in points if not p["variant"]}
    assert [p["bytes_sent"] for p in points if p["variant"]] == [measured["a2a"]]
    formula = comm_bytes(L=32, P=4, batch=1, heads=4, heads_kv=2, head_dim=8, dtype="fp32", a2a_size=2)
    for impl, comm in (("ring_p2p", "p2p"), ("a2a", "a2a"), ("a2a+p2p", "a2a+p2p")):
        assert measured[impl] == pytest.approx(formula[comm]["fwd_bwd"]), impl


def test_bench_attention_smoke(tmp_path: Path, gloo_pool: Any) -> None:
    points = run_attention_bench(lengths=[32], ranks=[2], impls=["single", "ring_p2p", "all_gather", "ulysses"],
                                 modes=["fwd", "fwd_bwd"], causals=[True], batch=1, heads=2, heads_kv=2, head_dim=8,
                                 dtype="fp32", repeats=1, warmup=0, backend="auto", progress=_quiet,
                                 pools=lambda size, threads: gloo_pool(size), own_sessions=False)
    out = tmp_path / "bench.json"
    data = write_attention_bench(points, machine_description(), out=out, argv=None, plots=tmp_path / "p")
    assert json.loads(out.read_text())["points"] == data["points"]
    assert data["machine"]["cores"] >= 1
    expected = {"single", "ring_p2p", "all_gather"} | ({"ulysses"} if ulysses_available() else set())
    assert {p["impl"] for p in points} == expected
    assert {p["mode"] for p in points} == {"fwd", "fwd_bwd"}
    for p in points:
        assert p["min_s"] <= p["median_s"] <= p["max_s"]
        assert p["peak_mem_bytes"] >= 0 and p["efficiency"] is not None
        if p["impl"] == "ring_p2p":
            assert p["P"] == 2 and 0.0 <= p["exposed_fraction"] <= 1.0
    fwd = {p["impl"]: p for p in points if p["mode"] == "fwd"}
    assert fwd["single"]["P"] == 1 and fwd["single"]["pool_P"] == 2  # timed beside the ring, on rank 0
    assert fwd["ring_p2p"]["bytes_sent"] == 2 * 16 * 2 * 8 * 4  # k and v of 16 local tokens, fp32, one step
    for name in ("time_vs_L.png", "efficiency_vs_P.png", "memory_vs_L.png"):
        assert (tmp_path / "p" / name).stat().st_size > 0
    # the planner puts the bench JSON beside its predictions
    plan_json = tmp_path / "plan.json"
    assert plan_main(["--layers", "2", "--hidden", "64", "--heads", "4", "--ffn", "256", "--batch", "1",
                      "--prompt-len", "64", "--hardware", "cpu-gloo", "--measured", str(out),
                      "--json", str(plan_json)]) == 0
    rows = json.loads(plan_json.read_text())["measured_vs_predicted"]
    assert len(rows) == len([p for p in points if p["impl"] != "ulysses"])


def test_bench_numerics_smoke(gloo_pool: Any) -> None:
    points = run_numerics(ranks=[1, 2], dtypes=["fp32", "bf16", "fp16"], causals=[True, False], seq=16, batch=1,
                          heads=2, heads_kv=2, head_dim=8, backend="auto", progress=_quiet,
                          pools=lambda size, threads: gloo_pool(size))
    assert len(points) == 2 * 3 * 2  # P x dtype x causal
    bound = {"fp32": 1e-5, "fp16": 5e-3, "bf16": 3e-2}
    for p in points:
        for key in ("out", "dq", "dk", "dv"):
            assert 0 <= p[key] < bound[p["dtype"]], p
    assert markdown_table(["dtype", "P"], [r[:2] for r in numerics_rows(points)]).startswith("| dtype | P |")


def test_cli_rejects_bad_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_attention_main(["--L", "30", "--P", "4", "--impl", "ring_p2p", "--no-plots",
                                 "--out", "/dev/null"]) == 2
    assert "megatron-ring bench attention: error: L = 30 is not divisible by 2*P = 8" in capsys.readouterr().err
    assert bench_numerics_main(["--P", "1", "3", "--L", "16", "--out", "/dev/null"]) == 2
    assert "P = 3 gives 2*P = 6" in capsys.readouterr().err
