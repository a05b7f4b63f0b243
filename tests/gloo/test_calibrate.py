"""``megatron-ring calibrate --quick`` end to end on 2 gloo ranks: plumbing, never the numbers."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_ring.cli import main
from megatron_ring.perf.planner.cost_model import Planner
from megatron_ring.perf.planner.hardware import HardwareProfile
from megatron_ring.perf.planner.plan_cli import load_plan_input

ROOT = Path(__file__).resolve().parents[2]


def test_calibrate_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cal.json"
    assert main(["calibrate", "--quick", "--ranks", "2", "--name", "ci", "--out", str(out)]) == 0
    assert "attention_efficiency" in capsys.readouterr().out
    hw = HardwareProfile.load(out)
    assert hw.name == "ci" and hw.cpu_cores and hw.cpu_cores >= 1
    assert all(v > 0 for v in hw.peak_flops.values()) and set(hw.peak_flops) == {"fp32", "bf16"}
    for name in ("hbm_bytes_per_s", "intra_node_bytes_per_s", "allreduce_bytes_per_s", "allgather_bytes_per_s",
                 "attention_efficiency", "memory_bytes"):
        assert getattr(hw, name) > 0, name
    assert hw.p2p_latency_s >= 0 and hw.collective_latency_s >= 0 and hw.layer_overhead_s > 0
    raw = json.loads(out.with_suffix(".raw.json").read_text())
    assert raw["quick"] and raw["ranks"] == 2 and len(raw["machine"]["loadavg_1_5_15"]) == 3
    assert set(raw["fits"]) == {"p2p", "all_reduce", "all_gather"}
    assert all(len(f["x"]) == 3 and "r2" in f for f in raw["fits"].values())
    # the planner takes it
    pred = Planner(hw).predict(load_plan_input(ROOT / "configs/deepspeed/cpu_ring_cp4.json"))
    assert pred.ttft_s > 0 and pred.terms_ms["tpot"]["layer_overhead"] > 0

