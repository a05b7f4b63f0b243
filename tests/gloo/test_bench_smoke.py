"""The bench commands end to end at tiny sizes: structure and correctness, never timings."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_ring.perf.bench_attention import bench_attention_main, ulysses_available
from megatron_ring.perf.bench_numerics import bench_numerics_main
from megatron_ring.perf.planner import plan_main


def test_bench_attention_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    rc = bench_attention_main(["--L", "32", "--P", "2", "--causal", "yes", "--repeats", "1", "--warmup", "0",
                               "--heads", "2", "--head-dim", "8", "--out", str(out), "--plots", str(tmp_path / "p")])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["machine"]["cores"] >= 1
    impls = {p["impl"] for p in data["points"]}
    expected = {"single", "ring_p2p", "all_gather"} | ({"ulysses"} if ulysses_available() else set())
    assert impls == expected
    assert {p["mode"] for p in data["points"]} == {"fwd", "fwd_bwd"}
    for p in data["points"]:
        assert p["min_s"] <= p["median_s"] <= p["max_s"]
        assert p["peak_mem_bytes"] >= 0 and p["efficiency"] is not None
        if p["impl"] == "ring_p2p":
            assert p["P"] == 2 and 0.0 <= p["exposed_fraction"] <= 1.0
            kv_block = 2 * 1 * 16 * 2 * 8 * 4  # k and v of 16 local tokens, fp32
            assert p["bytes_sent"] >= kv_block
    fwd = {p["impl"]: p for p in data["points"] if p["mode"] == "fwd"}
    assert fwd["ring_p2p"]["bytes_sent"] == 2 * 16 * 2 * 8 * 4  # one block, one step (P = 2)
    for name in ("time_vs_L.png", "efficiency_vs_P.png", "memory_vs_L.png"):
        assert (tmp_path / "p" / name).stat().st_size > 0
    # the planner reads the bench JSON beside its predictions
    plan_json = tmp_path / "plan.json"
    assert plan_main(["--layers", "2", "--hidden", "64", "--heads", "4", "--ffn", "256", "--batch", "1",
                      "--prompt-len", "64", "--hardware", "cpu-gloo", "--measured", str(out),
                      "--json", str(plan_json)]) == 0
    rows = json.loads(plan_json.read_text())["measured_vs_predicted"]
    assert len(rows) == len([p for p in data["points"] if p["impl"] != "ulysses"])


def test_bench_attention_rejects_bad_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_attention_main(["--L", "30", "--P", "4", "--impl", "ring_p2p", "--no-plots",
                                 "--out", "/dev/null"]) == 2
    assert "not divisible by 2*P = 8" in capsys.readouterr().out


def test_bench_numerics_smoke(tmp_path: Path) -> None:
    out, md = tmp_path / "num.json", tmp_path / "num.md"
    rc = bench_numerics_main(["--P", "1", "2", "--L", "16", "--batch", "1", "--heads", "2", "--head-dim", "8",
                              "--out", str(out), "--markdown", str(md)])
    assert rc == 0
    points = json.loads(out.read_text())["points"]
    assert len(points) == 2 * 3 * 2  # P x dtype x causal
    bound = {"fp32": 1e-5, "fp16": 5e-3, "bf16": 3e-2}
    for p in points:
        for key in ("out", "dq", "dk", "dv"):
            assert 0 <= p[key] < bound[p["dtype"]], p
    assert md.read_text().startswith("| dtype | P |")
