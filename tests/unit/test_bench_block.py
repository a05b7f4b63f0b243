"""bench_block on CPU: every backend exact against float64, the JSON written."""
import json

from megatron_ring.perf.bench_block import main


def test_bench_block_cpu(tmp_path):
    out = tmp_path / "block.json"
    assert main(["--lengths", "128", "--repeats", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    for row in result["exactness"]:
        tol = 1e-5 if row["dtype"] == "float32" or row["backend"] == "math" else 2e-2
        assert max(row[k] for k in ("out", "dq", "dk", "dv")) <= tol, row
    assert max(result["entry_points"].values()) <= 2e-2
    assert {r["backend"] for r in result["timings"]} == {"math", "sdpa", "torch_sdpa"}
