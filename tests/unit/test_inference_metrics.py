"""Metric definitions, the result table and the atomic result file (pure, no processes)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_ring.inference.loop import job_timings, make_prompt
from megatron_ring.inference.metrics import RequestTiming, format_table, median_metrics, percentile, request_metrics
from megatron_ring.runtime.reporting import write_json_atomic


def test_percentile_interpolates_between_closest_ranks() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 50) == 1.5
    assert percentile([1.0, 2.0, 3.0, 4.0, 100.0], 99) == pytest.approx(96.16)
    with pytest.raises(ValueError):
        percentile([], 50)


def test_request_metrics_follow_the_definitions() -> None:
    # 2 sequences of 10 prompt tokens; prefill 0.5 s; 3 decode steps of 0.1, 0.1, 0.4 s.
    m = request_metrics(RequestTiming(0.5, [0.1, 0.1, 0.4]), sequences=2, prompt_len=10)
    assert m["ttft_ms"] == pytest.approx(500)
    assert m["tpot_mean_ms"] == pytest.approx(200)
    assert m["tpot_p50_ms"] == pytest.approx(100)
    assert m["prefill_tps"] == pytest.approx(2 * 10 / 0.5)
    assert m["decode_tps"] == pytest.approx(2 * 3 / 0.6)
    assert m["overall_tps"] == pytest.approx(2 * 13 / 1.1)
    assert m["e2e_per_token_ms"] == pytest.approx(1100 / 4)
    with pytest.raises(ValueError, match="decode step"):
        request_metrics(RequestTiming(0.5, []), sequences=1, prompt_len=1)


def test_median_over_requests_and_slowest_rank_per_step() -> None:
    assert median_metrics([{"a": 1.0}, {"a": 5.0}, {"a": 2.0}]) == {"a": 2.0}
    fast, slow = [RequestTiming(1.0, [0.1, 0.3])], [RequestTiming(2.0, [0.2, 0.1])]
    (job,) = job_timings([fast, slow])
    assert job.prefill_s == 2.0 and job.step_s == [0.2, 0.3]


def test_prompt_is_reproducible_and_in_vocabulary() -> None:
    a, b = make_prompt(3, 16, 50, seed=7), make_prompt(3, 16, 50, seed=7)
    assert a.shape == (3, 16) and a.dtype.is_floating_point is False
    assert (a == b).all() and int(a.max()) < 50 and int(a.min()) >= 0


def test_atomic_write_never_leaves_a_partial_file(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "result.json"
    write_json_atomic(path, {"ok": 1})
    assert json.loads(path.read_text()) == {"ok": 1}
    with pytest.raises(TypeError):
        write_json_atomic(path, {"bad": object()})  # fails half-way through serialising
    assert json.loads(path.read_text()) == {"ok": 1}
    assert [p.name for p in path.parent.iterdir()] == ["result.json"]


def _result(name: str, tps: float) -> dict:
    metrics = {k: 1.0 for k in ("ttft_ms", "tpot_mean_ms", "tpot_p50_ms", "tpot_p99_ms", "prefill_tps",
                                "decode_tps", "e2e_per_token_ms")}
    metrics["overall_tps"] = tps
    rank = {"peak_mem_bytes": 2**20, "kv_cache_bytes": 2**20, "comm_prefill_bytes": 0, "comm_decode_bytes": 0}
    return {"name": name, "layout_text": "tp=1", "metrics": metrics, "ranks": [rank]}


def test_table_shows_every_metric_and_the_ratio() -> None:
    text = format_table([_result("base", 100.0), _result("ring", 150.0)], ratios=True)
    for label in ("TPS overall", "TTFT", "TPOT p99", "peak memory / rank", "sent in decode / rank"):
        assert label in text
    assert "1.500x" in text and "ring / base" in text
