"""bench train-memory's pure parts: the length search finds a known boundary, the cap names the rank, the
cap and the bytes, and bad plans are refused before any process starts."""
from __future__ import annotations

import math

import pytest

from megatron_ring.cli import main
from megatron_ring.perf.bench.length_search import longest_fitting
from megatron_ring.perf.bench.memory_cap import MemoryCapExceeded, check_cap, check_cap_bytes


def _limit(boundary: int):
    """A synthetic cost: a length fits when it is at most ``boundary``; every call recorded."""
    calls: list[int] = []

    def fits(length: int) -> bool:
        calls.append(length)
        return length <= boundary
    return fits, calls


@pytest.mark.parametrize("boundary", [8, 63, 64, 1000, 1024, 5000, 9999])
@pytest.mark.parametrize("start", [8, 64, 1024, 4096])
def test_search_finds_the_longest_multiple_of_the_unit(boundary, start):
    fits, calls = _limit(boundary)
    search = longest_fitting(fits, unit=8, start=start, ceiling=1 << 16)
    assert search.longest == boundary // 8 * 8
    assert not search.at_ceiling
    assert [length for length, _ in search.trials] == calls
    assert all(ok == (length <= boundary) for length, ok in search.trials)
    assert len(calls) <= 2 * math.log2(abs(boundary - start) / 8 + 1) + 3
    assert len(set(calls)) == len(calls), "no length is tried twice"


def test_search_reports_zero_when_not_one_unit_fits():
    fits, calls = _limit(5)
    search = longest_fitting(fits, unit=8, start=64, ceiling=1024)
    assert (search.longest, search.at_ceiling) == (0, False)
    assert calls == [64, 56, 48, 32, 8]


def test_search_stops_at_the_ceiling():
    fits, calls = _limit(10 ** 9)
    search = longest_fitting(fits, unit=8, start=64, ceiling=1000)
    assert (search.longest, search.at_ceiling) == (1000, True)
    assert calls == [64, 72, 80, 96, 128, 192, 320, 576, 1000]


@pytest.mark.parametrize("start, calls", [(2560, [2560, 2568]), (2568, [2568, 2560]), (2576, [2576, 2568, 2560])])
def test_a_start_near_the_limit_costs_a_few_calls(start, calls):
    fits, made = _limit(2563)
    assert longest_fitting(fits, unit=8, start=start, ceiling=1 << 16).longest == 2560
    assert made == calls


@pytest.mark.parametrize("kwargs, message", [
    ({"unit": 8, "start": 12, "ceiling": 64}, "start = 12: must be a positive multiple of unit = 8"),
    ({"unit": 8, "start": 8, "ceiling": 60}, "ceiling = 60: must be a positive multiple of unit = 8"),
    ({"unit": 8, "start": 128, "ceiling": 64}, "start = 128 is above ceiling = 64"),
])
def test_search_refuses_bad_bounds(kwargs, message):
    with pytest.raises(ValueError, match=message):
        longest_fitting(lambda n: True, **kwargs)


def test_cap_names_the_rank_the_cap_and_the_bytes():
    with pytest.raises(MemoryCapExceeded) as err:
        check_cap([100, 300, 250], 200, seq_len=4096, cp=3)
    assert (err.value.rank, err.value.cap_bytes, err.value.peak_bytes) == (1, 200, 300)
    assert str(err.value).startswith("rank 1 of cp = 3 at seq_len = 4096: peak 300 bytes")
    assert "exceeds the cap of 200 bytes" in str(err.value)


def test_a_peak_at_the_cap_fits():
    check_cap([200, 199], 200, seq_len=64, cp=2)


@pytest.mark.parametrize("cap", [0, -1, 1.5, True])
def test_cap_must_be_positive_bytes(cap):
    with pytest.raises(ValueError, match=f"cap_bytes = {cap!r}: the memory cap per process must be a positive"):
        check_cap_bytes(cap)


@pytest.mark.parametrize("argv, message", [
    (["--cap-mib", "0"], "argument --cap-mib: expected a finite number > 0, got 0"),
    (["--cp", "0"], "argument --cp: expected an integer >= 1, got 0"),
    (["--cp", "1", "3", "--unit", "64"], "unit = 64 is not divisible by 2 * cp = 6 for cp = 3 (zigzag sharding"),
    (["--cp", "1", "3", "--unit", "64"], "use a multiple of 6"),
    (["--cp", "2", "2"], "cp = [2, 2]: give distinct positive CP sizes"),
    (["--start", "1000"], "start = 1000 is not a positive multiple of unit = 64"),
    (["--start", "2048", "--ceiling", "1024"], "start = 2048 is above ceiling = 1024"),
    (["--model", "configs/megatron/tiny_local.yaml", "--cp", "1", "2"],
     "attention = 'local' (Megatron's DotProductAttention) needs parallel.cp = 1, got cp = 2"),
    (["--model", "no/such.yaml"], "config 'no/such.yaml' not found"),
    (["--replot"], "train_memory.json' does not exist; run without --replot first"),
])
def test_bad_flags_stop_before_any_work(argv, message, capsys, tmp_path):
    pytest.importorskip("pydantic")
    try:
        status = main(["bench", "train-memory", "--out-dir", str(tmp_path), *argv])
    except SystemExit as exit_:  # argparse's own type errors
        status = exit_.code
    assert status == 2
    err = capsys.readouterr().err
    assert "megatron-ring bench train-memory: error:" in err and message in err, err
    assert not any(tmp_path.iterdir()), "nothing written"


def _trial(seq_len: int, cp: int, peak: int, fits: bool) -> dict:
    return {"seq_len": seq_len, "peak_bytes_per_rank": [peak] * cp, "fits": fits, "seconds": 1.0,
            "weights_bytes": 10, "grads_bytes": 10, "optimizer_bytes": 20}


def test_replot_draws_and_tabulates_a_stored_run(tmp_path):
    pytest.importorskip("matplotlib")
    from megatron_ring.perf.bench.train_memory import _add_ratios
    from megatron_ring.perf.bench.train_memory_report import table_rows
    from megatron_ring.runtime.reporting import write_json_atomic

    points = [{"cp": cp, "longest_seq_len": longest, "at_ceiling": False, "peak_bytes": 1000 * 1024,
               "weights_bytes": 10, "grads_bytes": 10, "optimizer_bytes": 20,
               "trials": [_trial(longest, cp, 1000 * 1024, True), _trial(longest + 64, cp, 1100 * 1024, False)]}
              for cp, longest in ((1, 256), (2, 448), (4, 1024))]
    _add_ratios(points)
    assert [p["ratio_to_first"] for p in points] == [1.0, 1.75, 4.0]
    assert [p["ratio_per_doubling"] for p in points] == [None, 1.75, 1024 / 448]
    rows = table_rows(points)
    assert [row[:4] for row in rows] == [[1, "256", "1.00x", "-"], [2, "448", "1.75x", "1.75x"],
                                         [4, "1024", "4.00x", "2.29x"]]
    assert rows[0][7] == f"{(1000 * 1024 - 40) / 256 / 1024:.1f}", "the rest per local token, in KiB"
    result = {"model_config": "configs/megatron/x.yaml", "dtype": "fp32", "cap_bytes": 1024 * 1024,
              "machine": {"cpu": "cpu", "cores": 2}, "load_1_5_15_start": [0.0, 0.0, 0.0], "points": points}
    write_json_atomic(tmp_path / "train_memory.json", result)
    assert main(["bench", "train-memory", "--replot", "--out-dir", str(tmp_path)]) == 0
    assert (tmp_path / "train_memory.png").stat().st_size > 0
