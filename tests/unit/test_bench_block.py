"""``python -m megatron_ring.perf.bench.block`` on CPU: every backend exact against float64, the JSON written."""
import json

from megatron_ring.perf.bench.block import main


def test_bench_block_cpu(tmp_path):
    out = tmp_path / "block.json"
    assert main(["--lengths", "128", "--repeats", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    for row in result["exactness"]:
        tol = 1e-5 if row["dtype"] == "float32" or row["backend"] == "math" else 2e-2
        assert max(row[k] for k in ("out", "dq", "dk", "dv")) <= tol, row
    assert max(result["entry_points"].values()) <= 2e-2
    assert {r["backend"] for r in result["timings"]} == {"math", "sdpa", "torch_sdpa"}


def test_layout_timings_cover_both_storages():
    import torch

    from megatron_ring.perf.bench.block import time_layouts

    rows = time_layouts(torch.device("cpu"), 1, blocks=((32, 16, 2, False), (32, 32, 2, True)))
    assert [(r["q"], r["k"], r["causal"]) for r in rows] == [(32, 16, False), (32, 32, True)]
    for row in rows:
        assert row["fwd_ratio"] == row["fwd_ms_heads_first"] / row["fwd_ms_seq_first"] > 0
        assert row["fwd_bwd_ratio"] == row["fwd_bwd_ms_heads_first"] / row["fwd_bwd_ms_seq_first"] > 0
