"""Planner predictions of inference runs (predict.py), the profile's new fields, the calibration fit."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from megatron_ring.perf.planner.calibrate import fit_line
from megatron_ring.perf.planner.hardware import HardwareProfile
from megatron_ring.perf.planner.paper_scale import paper_scale_plan
from megatron_ring.perf.planner.predict import make_predictor, predict_inference

ROOT = Path(__file__).resolve().parents[2]
DS = ROOT / "configs/deepspeed"
CPU_CONFIGS = ("cpu_baseline_tp2_pp2", "cpu_ring_cp4", "cpu_ring_tp2_cp2")


def _toy(**update: float | None) -> HardwareProfile:
    """A GPU-style profile (one device per rank) with the given numbers changed."""
    return HardwareProfile.load("h100-sxm").model_copy(update=update)


COMPUTE_BOUND = _toy(peak_flops={"fp32": 1e9, "bf16": 1e9, "fp16": 1e9}, hbm_bytes_per_s=1e15,
                     intra_node_bytes_per_s=1e15, inter_node_bytes_per_s=1e15, p2p_latency_s=0.0,
                     collective_latency_s=0.0)
P2P_BOUND = _toy(peak_flops={"fp32": 1e18, "bf16": 1e18, "fp16": 1e18}, hbm_bytes_per_s=1e18,
                 intra_node_bytes_per_s=1e15, inter_node_bytes_per_s=1e15, p2p_latency_s=1e-2,
                 collective_latency_s=1e-6)


@pytest.mark.parametrize("name", CPU_CONFIGS)
@pytest.mark.parametrize("profile", ["cpu-gloo", "h100-sxm"])
def test_predict_inference_shipped_configs(name: str, profile: str) -> None:
    out = predict_inference(DS / f"{name}.json", prompt_len=48, batch=4, new_tokens=16, profile=profile)
    for key in ("ttft_s", "tpot_s", "tps", "prefill_tps", "decode_tps"):
        assert math.isfinite(out[key]) and out[key] > 0, key
    for metric in ("ttft", "tpot"):
        terms = out["terms_ms"][metric]
        assert sum(terms.values()) == pytest.approx(1e3 * out[f"{metric}_s"])
        assert out["dominant"][metric] == max(terms, key=terms.__getitem__)
    assert out["tps"] == pytest.approx(4 * (48 + 15) / (out["ttft_s"] + 15 * out["tpot_s"]))
    assert make_predictor(profile)(DS / f"{name}.json", 48, 4, 16) == out


def test_predict_paper_configs() -> None:
    for name in ("paper_baseline_tp8_pp2", "paper_ring_cp16"):
        out = predict_inference(DS / f"{name}.json", prompt_len=99872, batch=2, new_tokens=8, profile="h100-sxm")
        assert out["ttft_s"] > 0 and out["tpot_s"] > 0 and out["fits"]


def test_ring_vs_baseline_direction() -> None:
    def ratio(profile: HardwareProfile, key: str) -> float:
        ring, base = (predict_inference(DS / f"{n}.json", prompt_len=48, batch=4, new_tokens=16, profile=profile)
                      for n in ("cpu_ring_cp4", "cpu_baseline_tp2_pp2"))
        return ring[key] / base[key]

    # compute-bound: the ring computes on all 4 ranks at once; the baseline pipelines its 4 sequences
    # over 2 stages, (4 + 2 - 1) stage times of a quarter of the work: 1.25 against the ring's 1
    assert ratio(COMPUTE_BOUND, "ttft_s") == pytest.approx(0.8, rel=0.05)
    # but decode repeats the linear layers on every CP rank, and 15 decode steps after a 48-token
    # prompt outweigh the prefill: overall TPS favours the (pipelined) baseline here
    assert ratio(COMPUTE_BOUND, "tpot_s") > 1
    assert ratio(COMPUTE_BOUND, "tps") < 1
    # p2p latency-bound: 2 layers x 4 ring steps = 8 latencies (where latency dominates, the cost model keeps
    # whole blocks: no second head group, Note [Pieces per hop]) against the baseline's 4 + 2 - 1 = 5 stage sends
    assert ratio(P2P_BOUND, "ttft_s") == pytest.approx(8 / 5, rel=0.05)
    assert predict_inference(DS / "cpu_ring_cp4.json", prompt_len=48, batch=4, new_tokens=16,
                             profile=P2P_BOUND)["dominant"]["ttft"] == "ring_comm"


def test_cpu_ranks_share_the_machine() -> None:
    hw = HardwareProfile.load("cpu-gloo")  # 2 cores
    assert hw.host_slowdown(ranks=4) == 2.0 and hw.host_slowdown(ranks=1) == 1.0
    assert hw.flops("fp32", kind="matmul", ranks=4) == pytest.approx(69e9 / 2)
    assert hw.hbm(ranks=4) == pytest.approx(20e9 / 4)
    gpu = HardwareProfile.load("h100-sxm")
    assert gpu.host_slowdown(ranks=16) == 1.0 and gpu.hbm(ranks=16) == pytest.approx(3.35e12 * 0.8)


def test_collectives_default_to_the_link() -> None:
    hw = HardwareProfile.load("h100-sxm")
    link = 450e9 * 0.8
    assert hw.collective_s("all_reduce", 1e6, 8, cross_node=False) == pytest.approx(40e-6 + 2 * 7 / 8 * 1e6 / link)
    assert hw.collective_s("all_gather", 1e6, 4, cross_node=False) == pytest.approx(40e-6 + 3 * 1e6 / link)
    assert hw.collective_s("all_reduce", 1e6, 1, cross_node=False) == 0.0
    tuned = _toy(allreduce_bytes_per_s=1e9, allgather_bytes_per_s=2e9, allgather_latency_s=1e-3)
    assert tuned.collective_s("all_reduce", 1e6, 2, cross_node=False) == pytest.approx(40e-6 + 1e-3)
    assert tuned.collective_s("all_gather", 1e6, 2, cross_node=False) == pytest.approx(1e-3 + 5e-4)
    assert tuned.collective_s("all_gather", 1e6, 2, cross_node=True) == pytest.approx(1e-3 + 1e6 / (50e9 * 0.8))
    with pytest.raises(ValueError, match="kind must be"):
        hw.collective_s("broadcast", 1.0, 2, cross_node=False)


def test_fit_line() -> None:
    fit = fit_line([1.0, 2.0, 4.0], [3.0, 5.0, 9.0])  # t = 1 + x / 0.5
    assert fit["alpha"] == pytest.approx(1.0) and fit["beta"] == pytest.approx(0.5) and fit["r2"] == pytest.approx(1)
    assert not fit["clamped"]
    flat = fit_line([1.0, 2.0, 4.0], [3.0, 2.0, 2.5])  # size made no difference
    assert flat["clamped"] == ["slope"] and flat["alpha"] == 2.0 and flat["beta"] == pytest.approx(4.0 / 2.5)
    neg = fit_line([1.0, 2.0], [0.5, 2.0])
    assert neg["clamped"] == ["alpha"] and neg["alpha"] == 0.0


def test_paper_scale_plan() -> None:
    entries = paper_scale_plan(DS / "paper_baseline_tp8_pp2.json", DS / "paper_ring_cp16.json",
                               profiles=("h100-sxm-nvlink-switch",))
    full, fit = entries
    assert full["batch"] == 128 and not full["baseline"]["fits"] and not full["ring"]["fits"]
    assert 30 <= fit["batch"] < 128 and fit["baseline"]["fits"] and fit["ring"]["fits"]
    assert fit["tps_ratio"] == pytest.approx(fit["ring"]["tps"] / fit["baseline"]["tps"])
    assert fit["tps_ratio"] > 1  # one NVLink domain: the ring's transfers hide behind its compute
