"""``megatron-ring sweep`` under the real DeepSpeed launcher: a 1-process baseline (tiny GPT, Megatron's
attention) against ring attention over 2 processes, two prompt lengths, one repeat each."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from megatron_ring.perf.sweep.cli import sweep_main
from megatron_ring.perf.sweep.run import run_sweep
from megatron_ring.perf.sweep.schema import load_sweep
from megatron_ring.runtime.reporting import write_json_atomic

pytestmark = [pytest.mark.integration, pytest.mark.launcher]

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "configs" / "megatron"
needs_launcher = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None or importlib.util.find_spec("megatron") is None
    or not (Path(sys.executable).parent / "deepspeed").exists(), reason="deepspeed launcher and megatron-core needed")


def tiny_pair(tmp_path: Path) -> tuple[Path, Path]:
    """Baseline (tiny_local, 1 process) and ring (tiny_ring_cp2, 2 processes), model files named relative to
    the configs (seq_length 64; prompt lengths must be divisible by 4 and at most 61 with 4 new tokens)."""
    paths = []
    for name, model, cp in (("tiny_local", "tiny_local.yaml", 1), ("tiny_ring_cp2", "tiny_ring_cp2.yaml", 2)):
        cfg = {"dtype": "fp32", "replace_with_kernel_inject": False,
               "megatron_ring": {"model": {"runner": "megatron", "config": os.path.relpath(MODELS / model, tmp_path)},
                                 "layout": {"cp": cp},
                                 "workload": {"batch": 2, "prompt_len": 16, "new_tokens": 6, "warmup": 0,
                                              "repeats": 1, "seed": 5}}}
        paths.append(write_json_atomic(tmp_path / f"{name}.json", cfg))
    return paths[0], paths[1]


def fake_predict(config: Path, prompt_len: int, batch: int, new_tokens: int) -> dict[str, float]:
    return {"ttft_s": 1e-4 * prompt_len, "tpot_s": 2e-3, "tps": batch * (prompt_len + new_tokens - 1) / 0.1}


@needs_launcher
@pytest.mark.timeout(900)
def test_sweep_end_to_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two launches (torchrun) at one length: every result kept, the workload overridden, sweep.json valid with
    provenance, three PNGs (several lengths, their order and the crossover: tests/unit/test_sweep.py's fake
    launches)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    baseline, ring = tiny_pair(tmp_path)
    out = tmp_path / "sweep"
    run_sweep(baseline, ring, lengths=[32], repeats=1, new_tokens=4, out_dir=out, predict=fake_predict,
              command="test sweep", launcher="torchrun")  # the lighter launcher; compare's tests use DeepSpeed's
    summary = load_sweep(out / "sweep.json")
    assert [(p.prompt_len, p.batch, p.new_tokens) for p in summary.points] == [(32, 2, 4)]
    for point in summary.points:
        base, ring_run = (json.loads((out / side.runs[0]).read_text()) for side in (point.baseline, point.ring))
        assert base["workload"] == ring_run["workload"] == {
            "batch": 2, "prompt_len": point.prompt_len, "new_tokens": 4, "warmup": 0, "repeats": 1, "seed": 5,
            "text": None}
        assert base["generated"] == ring_run["generated"], "same weights and prompts, greedy: same tokens"
        assert point.baseline.ttft_s.median > 0 and point.ring.peak_mem_bytes.median > 0
        assert point.ratio.tps == pytest.approx(point.ring.tps.median / point.baseline.tps.median)
        assert point.predicted["ring"].ttft_s == pytest.approx(1e-4 * point.prompt_len)
        assert point.relative_error["baseline"].tpot_s == pytest.approx(2e-3 / point.baseline.tpot_s.median - 1)
    assert sorted(p.name for p in (out / "runs").glob("*.json")) == [
        f"{name}_L32_b2_r0.json" for name in ("tiny_local", "tiny_ring_cp2")]
    prov = summary.provenance
    assert prov.command == "test sweep" and prov.git_commit and len(prov.git_commit) == 40
    assert prov.machine.hostname and prov.machine.cpu_count and prov.machine.platform
    assert all(isinstance(n, int) and n >= 1 for n in prov.machine.threads_per_rank.values())
    assert len(prov.load_before) == len(prov.load_after) == 3
    assert prov.noisy == (max(prov.load_before[0], prov.load_after[0]) > prov.machine.cpu_count)
    assert set(summary.crossover) == {"tps", "ttft_s", "tpot_s"}
    for plot in ("sweep_ratios.png", "sweep_latency.png", "sweep_memory.png"):
        assert (out / plot).stat().st_size > 10_000


@needs_launcher
@pytest.mark.timeout(300)
def test_bad_lengths_fail_before_any_launch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A length not divisible by 2*cp and one past the model's seq_length: exit 2, both named, nothing run."""
    baseline, ring = tiny_pair(tmp_path)
    out = tmp_path / "sweep"
    code = sweep_main([str(baseline), str(ring), "--lengths", "16", "30", "64", "--out-dir", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert "megatron-ring sweep: error: sweep rejected before any launch" in err
    assert "point L=30 batch=2 (ring tiny_ring_cp2.json)" in err and "divisible" in err
    assert "point L=64 batch=2 (baseline tiny_local.json)" in err and "exceeds model.seq_length = 64" in err
    assert "L=16" not in err
    assert not (out / "runs").exists() and not (out / "sweep.json").exists()
