"""``python -m megatron_ring.perf.bench.gather`` on 2 gloo ranks: plumbing and JSON, never the timings."""
import json

import pytest

from megatron_ring.perf.bench.gather import TRANSPORTS, main


def test_bench_gather_writes_every_transport(tmp_path, capsys):
    out = tmp_path / "gather.json"
    assert main(["--ranks", "2", "--mib", "0.01", "0.02", "--repeats", "1", "--warmup", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["mib"] for r in rows] == [0.01, 0.02]
    for row in rows:
        assert all(row[f"{name}_s"] > 0 for name in TRANSPORTS)
        assert row["collective_over_pairwise"] == row["collective_s"] / row["pairwise_s"]
    assert "coll/pair" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [(["--ranks", "1"], "--ranks must be at least 2, got 1"),
                                           (["--mib", "0"], "--mib must be positive, got [0.0]")])
def test_bench_gather_refuses_bad_flags(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err
