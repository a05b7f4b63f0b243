"""Probe sweep, the ``megatron-ring`` command: each case a real command in its own session, under a
hard timeout; a usage error is one line and exit 2, a huge layout finishes, nothing is left behind."""
from __future__ import annotations

from pathlib import Path

import pytest

from megatron_ring.parallel.layout import ParallelLayout
from tests.probe.harness import ROOT, assert_clean, assert_usage_error, run_cli

USAGE = {  # case -> (argv, needles)
    "no command": ([], ["megatron-ring"]),
    "layout --tp 0": (["layout", "--tp", "0"], ["--tp: expected an integer >= 1, got 0"]),
    "layout --world mismatch": (["layout", "--tp", "8", "--pp", "2", "--world", "4"], ["layout world size 16"]),
    "layout --cp-a2a not a divisor": (["layout", "--cp", "4", "--cp-a2a", "3"], ["cp_a2a"]),
    "layout unknown flag": (["layout", "--bogus"], ["unrecognized arguments: --bogus"]),
    "bench attention --L 0": (["bench", "attention", "--L", "0"], ["--L"]),
    "compare unknown pair": (["compare", "no-such-pair"], ["no-such-pair"]),
    "plan missing config": (["plan", "nowhere.json"], ["nowhere.json"]),
    "infer missing config": (["infer", "--deepspeed_config", "nowhere.json"], ["nowhere.json"]),
}


@pytest.mark.parametrize("case", list(USAGE))
def test_usage_error_is_one_line_and_exit_2(case: str) -> None:
    argv, needles = USAGE[case]
    assert_usage_error(run_cli(*argv), *needles)


@pytest.mark.parametrize("sizes", [{"cp": 10000}, {"tp": 8, "cp": 512}], ids=["cp 10000", "tp 8 x cp 512"])
def test_huge_layout_finishes_and_is_right(sizes: dict[str, int]) -> None:
    flags = [x for axis, size in sizes.items() for x in (f"--{axis}", str(size))]
    outcome = run_cli("layout", *flags, timeout_s=90)
    assert outcome.code == 0, outcome.err
    layout = ParallelLayout(**sizes)
    rows = [ln.split() for ln in outcome.out.splitlines() if ln.strip() and ln.split()[0].isdigit()]
    assert len(rows) == layout.world_size
    for rank in (0, layout.world_size // 2, layout.world_size - 1):
        prev, nxt = layout.ring_neighbours(rank, "cp")
        assert rows[rank][5:] == [str(prev), "->", str(rank), "->", str(nxt)], rows[rank]
    assert max(map(len, outcome.out.splitlines())) < 400, "a group printed whole"


def test_calibrate_out_under_a_file_fails_before_measuring() -> None:
    assert_usage_error(run_cli("calibrate", "--out", str(ROOT / "README.md" / "x.json"), timeout_s=30), "--out")


def test_bench_out_under_a_file_fails_before_measuring() -> None:
    argv = ["bench", "attention", "--L", "256", "--P", "2", "--out", str(ROOT / "README.md" / "x.json")]
    assert_usage_error(run_cli(*argv, timeout_s=30), "--out")


def test_sweep_out_dir_under_a_file_fails_before_running() -> None:
    argv = ["sweep", "cpu", "--lengths", "48", "--out-dir", str(ROOT / "README.md" / "d")]
    assert_usage_error(run_cli(*argv, timeout_s=30), "--out-dir")


def test_compare_out_dir_under_a_file_fails_before_running() -> None:
    assert_usage_error(run_cli("compare", "cpu", "--out-dir", str(ROOT / "README.md" / "d"), timeout_s=30), "--out-dir")


def test_perplexity_out_under_a_file_fails_before_running() -> None:
    assert_usage_error(run_cli("perplexity", "--out", str(ROOT / "README.md" / "p.json"), timeout_s=30), "--out")


def test_plan_markdown_under_a_file_is_a_usage_error() -> None:
    argv = ["plan", str(ROOT / "configs" / "deepspeed" / "cpu_ring_cp4.json"), "--markdown",
            str(ROOT / "README.md" / "plan.md")]
    assert_usage_error(run_cli(*argv, timeout_s=60), "--markdown")


def test_plan_of_a_shipped_config_runs_clean(tmp_path: Path) -> None:
    out = run_cli("plan", str(ROOT / "configs" / "deepspeed" / "cpu_ring_cp4.json"), "--json",
                  str(tmp_path / "plan.json"), timeout_s=60)
    assert out.code == 0, out.err
    assert_clean(out.err)
    assert (tmp_path / "plan.json").read_text().startswith("{")
