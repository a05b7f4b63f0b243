"""The analytical planner: FLOP counts, the paper's KV-cache finding, loading, CLI and --measured."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_ring.parallel.layout import ParallelLayout
from megatron_ring.costs.comm_choice import PROFILE_DIR
from megatron_ring.costs.traffic import p2p_forward_messages
from megatron_ring.perf.planner.cost_model import Planner
from megatron_ring.perf.planner.hardware import HardwareProfile, profile_names
from megatron_ring.perf.planner.inputs import ModelDims, PlanInput, Workload, alternative_layout, layer_costs
from megatron_ring.perf.planner.measured import compare_measured
from megatron_ring.perf.planner.plan_cli import load_plan_input, plan_main

ROOT = Path(__file__).resolve().parents[2]
PAPER = ModelDims(num_layers=16, hidden_size=4096, num_heads=32, ffn_hidden_size=16384)
PAPER_WORK = Workload(batch=128, prompt_len=100_000, new_tokens=1)


def paper(layout: ParallelLayout, workload: Workload = PAPER_WORK) -> PlanInput:
    return PlanInput(name="paper", model=PAPER, layout=layout, workload=workload, dtype="bf16")


def test_layer_flops() -> None:
    c = layer_costs(PAPER, batch=1, seq=1000, element_size=2, causal=False)
    d, f = 4096, 16384
    assert c["qkv_proj"]["flops"] == 2 * 1000 * d * 3 * d
    assert c["out_proj"]["flops"] == 2 * 1000 * d * d
    assert c["mlp"]["flops"] == 2 * 1000 * 2 * d * f
    assert c["attention"]["flops"] == 4 * 1000 * 1000 * d
    causal = layer_costs(PAPER, batch=1, seq=1000, element_size=2, causal=True)
    assert causal["attention"]["flops"] == c["attention"]["flops"] / 2


def test_paper_config_kv_cache_does_not_fit() -> None:
    planner = Planner(HardwareProfile.load("h100-sxm"))
    for layout in (ParallelLayout(tp=8, pp=2), ParallelLayout(cp=16)):
        pred = planner.predict(paper(layout))
        total_kv = pred.memory.kv_cache * 16
        assert total_kv == pytest.approx(3.36e12, rel=2e-3)
        assert not pred.memory.fits
        assert any("3.36 TB" in f and "1.28 TB" in f for f in pred.findings)
        # what fits: a smaller batch at 100k, or a shorter prompt at B = 128
        assert 30 <= pred.max_batch <= 44
        fits = planner.predict(paper(layout, Workload(batch=pred.max_batch, prompt_len=100_000)))
        assert fits.memory.fits
        over = planner.predict(paper(layout, Workload(batch=pred.max_batch + 1, prompt_len=100_000)))
        assert not over.memory.fits


def test_ring_crossover_and_links() -> None:
    dgx = Planner(HardwareProfile.load("h100-sxm")).ring_step(paper(ParallelLayout(cp=16)))
    nvl = Planner(HardwareProfile.load("h100-sxm-nvlink-switch")).ring_step(paper(ParallelLayout(cp=16)))
    assert dgx.tokens_per_rank == nvl.tokens_per_rank == 6250
    assert dgx.link == "inter-node" and nvl.link == "intra-node"
    assert dgx.crossover_tokens > dgx.tokens_per_rank  # IB: communication-bound
    assert nvl.crossover_tokens < nvl.tokens_per_rank  # NVLink: compute-bound, exposed ~ latency only
    # one latency per ring step and per extra message of the relay's head groups: at 6,250 tokens of a micro-batch
    # of one per rank the cost model keeps whole blocks (Note [Pieces per hop])
    steps = 1 + p2p_forward_messages(16, 1)
    assert nvl.exposed_s == pytest.approx(steps * HardwareProfile.load("h100-sxm-nvlink-switch").p2p_latency_s)
    assert dgx.exposed_s > 0


def test_alternative_layouts() -> None:
    hw = HardwareProfile.load("h100-sxm")
    assert alternative_layout(ParallelLayout(tp=8, pp=2), hw) == ParallelLayout(cp=16)
    assert alternative_layout(ParallelLayout(cp=16), hw) == ParallelLayout(tp=8, pp=2)


def test_validation_messages() -> None:
    with pytest.raises(ValueError, match="num_layers = 16 is not divisible by layout.pp = 3"):
        paper(ParallelLayout(pp=3))
    with pytest.raises(ValueError, match="prompt_len = 100 is not divisible by 2\\*layout.cp = 16"):
        paper(ParallelLayout(cp=8), Workload(batch=1, prompt_len=100))
    with pytest.raises(ValueError, match="dtype must be one of"):
        PlanInput(name="x", model=PAPER, layout=ParallelLayout(), workload=PAPER_WORK, dtype="int8")
    with pytest.raises(ValueError, match="workload.batch must be an int >= 1"):
        Workload(batch=0, prompt_len=8)


def test_profiles_load_and_reject_typos(tmp_path: Path) -> None:
    assert {"h100-sxm", "h100-sxm-nvlink-switch", "cpu-gloo"} <= set(profile_names())
    data = json.loads((PROFILE_DIR / "h100-sxm.json").read_text())
    data["hbm_bytes_per_sec"] = data.pop("hbm_bytes_per_s")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="did you mean 'hbm_bytes_per_s'"):
        HardwareProfile.load(bad)
    with pytest.raises(ValueError, match="not found; bundled profiles"):
        HardwareProfile.load("tpu-v9")


def test_load_megatron_yaml() -> None:
    p = load_plan_input(ROOT / "configs/megatron/paper_dense_sdpa_tp8_pp2.yaml", batch=4)
    assert p.layout == ParallelLayout(tp=8, pp=2)
    assert p.model.num_layers == 16 and p.model.head_dim == 128 and p.model.vocab_size == 32000
    assert p.workload.batch == 4 and p.workload.prompt_len == 100_000 and p.dtype == "bf16"


def test_load_deepspeed_json(tmp_path: Path) -> None:
    cfg = {"dtype": "bf16", "megatron_ring": {
        "model": {"runner": "megatron", "config": str(ROOT / "configs/megatron/tiny_ring_cp4.yaml")},
        "layout": {"tp": 1, "pp": 1, "cp": 4, "dp": 1},
        "workload": {"batch": 2, "prompt_len": 64, "new_tokens": 4}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    p = load_plan_input(path)
    assert p.layout == ParallelLayout(cp=4) and p.workload == Workload(batch=2, prompt_len=64, new_tokens=4)
    assert p.dtype == "bf16" and p.model.hidden_size == 64


def test_plan_cli_and_measured(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bench = {"points": [
        {"impl": "ring_p2p", "mode": "fwd", "causal": True, "L": 256, "P": 2, "dtype": "fp32", "batch": 1,
         "heads": 4, "heads_kv": 4, "head_dim": 32, "median_s": 0.01},
        {"impl": "single", "mode": "fwd_bwd", "causal": False, "L": 256, "P": 1, "dtype": "fp32", "batch": 1,
         "heads": 4, "heads_kv": 4, "head_dim": 32, "median_s": 0.02},
    ]}
    measured = tmp_path / "bench.json"
    measured.write_text(json.dumps(bench))
    out = tmp_path / "plan.json"
    rc = plan_main(["--layers", "16", "--hidden", "4096", "--heads", "32", "--ffn", "16384", "--batch", "128",
                    "--prompt-len", "100000", "--tp", "8", "--pp", "2", "--measured", str(measured),
                    "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "3.36 TB" in text and "1.28 TB" in text and "cp=16" in text and "tp=8 pp=2" in text
    data = json.loads(out.read_text())
    assert [p["label"] for p in data["plans"]] == ["tp=8 pp=2", "cp=16"]
    rows = data["measured_vs_predicted"]
    assert len(rows) == 2 and all(r["predicted_s"] > 0 for r in rows)
    assert compare_measured(bench, HardwareProfile.load("cpu-gloo"))[0]["impl"] == "ring_p2p"


def test_plan_cli_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_main(["--layers", "16"]) == 2
    assert "megatron-ring plan: error: without a config file, give" in capsys.readouterr().err


def test_every_cp_comm_is_predicted_and_auto_takes_the_fastest() -> None:
    """cp 16 over two nodes of 8 H100s: the flat ring pays the inter-node link on every step;
    a2a+p2p (a2a within a node) is predicted fastest, and --cp-comm auto uses it."""
    planner = Planner(HardwareProfile.load("h100-sxm"))
    fixed = planner.predict(paper(ParallelLayout(cp=16)))
    times = fixed.ring.comm_times
    assert set(times) == {"p2p", "all_gather", "a2a", "a2a+p2p"} and fixed.ring.comm == "p2p"
    assert times["a2a+p2p"] == min(times.values())
    assert any("a2a+p2p is predicted faster than p2p" in f for f in fixed.findings)
    auto = planner.predict(PlanInput(name="paper", model=PAPER, layout=ParallelLayout(cp=16), workload=PAPER_WORK,
                                     cp_comm="auto"))
    assert auto.ring.comm == "a2a+p2p" and auto.ttft_s < fixed.ttft_s
    mqa = ModelDims(num_layers=16, hidden_size=4096, num_heads=24, ffn_hidden_size=16384, num_kv_heads=1,
                    head_dim=128)
    odd = planner.predict(PlanInput(name="mqa", model=mqa, layout=ParallelLayout(cp=16), workload=PAPER_WORK))
    assert odd.ring.comm_times["a2a"] == float("inf")  # 24 heads do not split 16 ways


def test_comm_figure_curves_and_png(tmp_path: Path) -> None:
    from megatron_ring.attention.comms import COMMS
    from megatron_ring.perf.planner.comm_figure import comm_curves, draw_comm_figure

    planner = Planner(HardwareProfile.load("h100-sxm"))
    base = paper(ParallelLayout(cp=16))
    curves = comm_curves(planner, base, [4096, 65536])
    for i in range(2):
        assert COMMS[int(curves["auto"][i])] == min(COMMS, key=lambda c: curves[c][i])
    assert draw_comm_figure(planner, base, tmp_path / "c.png").stat().st_size > 10_000
