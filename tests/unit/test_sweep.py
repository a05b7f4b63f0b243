"""``megatron-ring sweep`` without launches: crossover interpolation, the run order, the summary, the plots
and the schema of sweep.json (the launches are replaced by a fake ``compare.run_config``)."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from megatron_ring.config import ConfigError
from megatron_ring.inference import compare
from megatron_ring.perf.sweep.run import run_sweep
from megatron_ring.perf.sweep.schema import load_sweep
from megatron_ring.perf.sweep.summary import crossings
from megatron_ring.runtime.reporting import write_json_atomic

ROOT = Path(__file__).resolve().parents[2]
needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="configs are validated with DeepSpeed's schema")
TOY = {"num_layers": 1, "hidden_size": 32, "num_attention_heads": 2, "ffn_hidden_size": 64, "vocab_size": 64}
LENGTHS = (32, 128)


def test_crossings_interpolate_linearly_in_log2_length() -> None:
    assert crossings([32, 128], [0.5, 1.5]) == [64.0]  # halfway in log2: 2^((5 + 7) / 2)
    (x,) = crossings([32, 128], [0.5, 2.0])
    assert math.isclose(x, 2 ** (5 + 2 * (1 / 3)))
    assert crossings([16, 32, 64], [2.0, 0.5, 2.0]) == [pytest.approx(2 ** (4 + 2 / 3)),
                                                         pytest.approx(2 ** (5 + 1 / 3))]
    assert crossings([16, 32, 64], [0.5, 1.0, 2.0]) == [32.0]  # a point exactly at parity, counted once
    assert crossings([16, 32], [0.5, 0.9]) == [] and crossings([16], [2.0]) == []


def toy_pair(tmp_path: Path) -> tuple[Path, Path]:
    """A baseline (cp 1) and a ring (cp 2) toy config whose model file is named relative to them."""
    write_json_atomic(tmp_path / "models" / "toy.json", TOY)
    paths = []
    for name, cp in (("toy_base", 1), ("toy_ring_cp2", 2)):
        cfg = {"dtype": "fp32", "replace_with_kernel_inject": False,
               "megatron_ring": {"model": {"runner": "toy", "config": "../models/toy.json"}, "layout": {"cp": cp},
                                 "workload": {"batch": 2, "prompt_len": 8, "new_tokens": 4, "warmup": 0,
                                              "repeats": 1},
                                 "output": "results/never_written.json"}}
        paths.append(write_json_atomic(tmp_path / "configs" / f"{name}.json", cfg))
    return paths[0], paths[1]


class FakeLaunches:
    """Stands in for ``compare.run_config``: records the order and writes a result whose numbers follow
    from the config: baseline TTFT = L ms x (repeat + 1); the ring's is L / 64 times that."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, config: Path, out_dir: Path, *, launcher: str, name: str) -> dict:
        ours = json.loads(config.read_text())["megatron_ring"]
        assert Path(ours["model"]["config"]).is_absolute() and "output" not in ours
        length, rep = ours["workload"]["prompt_len"], int(name.rsplit("_r", 1)[1])
        scale = (length / 64 if "ring" in name else 1.0) * (rep + 1)
        result = {"metrics": {"overall_tps": 1000 / scale, "ttft_ms": length * scale, "tpot_p50_ms": 2 * scale},
                  "ranks": [{"peak_mem_bytes": 2**20 * scale}, {"peak_mem_bytes": 2**19}],
                  "threads_per_rank": 1, "workload": ours["workload"]}
        write_json_atomic(out_dir / f"{name}.json", result)
        self.calls.append(name)
        return result


def fake_predict(config: Path, prompt_len: int, batch: int, new_tokens: int) -> dict[str, float]:
    assert config.is_file() and new_tokens == 4
    return {"ttft_s": prompt_len * 1e-3, "tpot_s": 4e-3, "tps": 500.0}


@pytest.fixture
def fake_sweep(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
               capsys: pytest.CaptureFixture[str]) -> tuple[Path, FakeLaunches, str]:
    """A whole sweep of the toy pair over two lengths, three repeats, with predictions, on fake launches;
    (out dir, launches, stderr)."""
    launches = FakeLaunches()
    monkeypatch.setattr(compare, "run_config", launches)
    monkeypatch.setattr("os.getloadavg", lambda: (99.0, 1.0, 1.0))
    baseline, ring = toy_pair(tmp_path)
    run_sweep(baseline, ring, lengths=LENGTHS, repeats=3, out_dir=tmp_path / "out", predict=fake_predict,
              command="megatron-ring sweep test")
    return tmp_path / "out", launches, capsys.readouterr().err


@needs_deepspeed
def test_sweep_alternates_sides_and_summarises_repeats(fake_sweep: tuple[Path, FakeLaunches, str]) -> None:
    out, launches, err = fake_sweep
    assert launches.calls == [f"{side}_L{length}_b2_r{rep}" for length in LENGTHS for rep in range(3)
                              for side in ("toy_base", "toy_ring_cp2")]
    summary = load_sweep(out / "sweep.json")
    assert [(p.prompt_len, p.batch, p.new_tokens) for p in summary.points] == [(32, 2, 4), (128, 2, 4)]
    first = summary.points[0]
    assert (first.baseline.ttft_s.min, first.baseline.ttft_s.median, first.baseline.ttft_s.max) == \
        pytest.approx((0.032, 0.064, 0.096))
    assert first.ratio.ttft_s == pytest.approx(0.5) and first.ratio.tps == pytest.approx(2.0)
    assert first.baseline.peak_mem_bytes.median == 2 * 2**20  # max over ranks, median over repeats
    assert first.baseline.runs == ["runs/toy_base_L32_b2_r0.json", "runs/toy_base_L32_b2_r1.json",
                                   "runs/toy_base_L32_b2_r2.json"]
    assert all((out / run).is_file() for run in first.ring.runs)
    assert summary.crossover["ttft_s"]["2"] == [pytest.approx(2 ** (5 + 2 / 3))]
    assert first.predicted["ring"].ttft_s == 0.032
    assert first.relative_error["baseline"].ttft_s == pytest.approx((0.032 - 0.064) / 0.064)
    prov = summary.provenance
    assert prov.noisy and prov.load_before == [99.0, 1.0, 1.0] and prov.command == "megatron-ring sweep test"
    assert prov.machine.threads_per_rank == {"baseline": 1, "ring": 1}
    assert "WARNING: noisy machine: 1-minute load average 99.00" in err
    for plot in ("sweep_ratios.png", "sweep_latency.png", "sweep_memory.png"):
        assert (out / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def stored_sweeps() -> list[Path]:
    return sorted((ROOT / "docs" / "results").glob("**/sweep.json"))


@pytest.mark.parametrize("path", stored_sweeps(), ids=lambda p: str(p.relative_to(ROOT)))
def test_stored_sweep_validates(path: Path) -> None:
    load_sweep(path)


@needs_deepspeed
def test_sweep_schema_accepts_a_fresh_sweep_and_rejects_a_broken_one(fake_sweep: tuple[Path, FakeLaunches, str],
                                                                     tmp_path: Path) -> None:
    """The check the stored sweeps go through: a fresh file passes, a field missing or unknown fails."""
    data = json.loads((fake_sweep[0] / "sweep.json").read_text())
    load_sweep(fake_sweep[0] / "sweep.json")
    del data["points"][0]["ratio"]["tps"]
    data["points"][0]["ring"]["ttft"] = 1.0
    write_json_atomic(tmp_path / "broken.json", data)
    with pytest.raises(ConfigError) as err:
        load_sweep(tmp_path / "broken.json")
    assert "points.0.ratio.tps: missing; this key is required" in str(err.value)
    assert "unknown key 'points.0.ring.ttft' (did you mean 'ttft_s'?)" in str(err.value)


@needs_deepspeed
def test_configs_disagreeing_on_batch_need_batches(tmp_path: Path) -> None:
    baseline, ring = toy_pair(tmp_path)
    data = json.loads(ring.read_text())
    data["megatron_ring"]["workload"]["batch"] = 3
    write_json_atomic(ring, data)
    with pytest.raises(ConfigError, match=r"disagree on workload\.batch .*give --batches"):
        run_sweep(baseline, ring, lengths=[32], out_dir=tmp_path / "out")
