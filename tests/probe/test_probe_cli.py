"""Probe sweep, the ``megatron-ring`` command: a usage error is one line and exit 2, a huge layout
finishes, a command whose output cannot be written fails before it starts anything, nothing is left behind.

The usage errors run the command's function in this process (``cli.main``, what ``megatron-ring``
runs; one subprocess each would cost a torch import); ``no command`` also runs as a real process, as
does every case that could start ranks or write files: each in its own session under a hard timeout,
whose processes must all be gone after it. Those commands are independent, so the module starts the
selected ones side by side (:func:`launched`, a few at a time); each test waits for its own command.
"""
from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Iterator

import pytest

from megatron_ring.parallel.layout import ParallelLayout
from tests.probe.harness import ROOT, Outcome, assert_clean, assert_usage_error, run_cli, run_in_process

pytestmark = pytest.mark.launcher
# the perplexity cases import transformers in this process: its log handler binds the stderr of its first
# use, which must be pytest's, not one test's capsys (closed after that test)
__import__("transformers").logging.get_logger()

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
    "check missing config": (["check", "nowhere.json"], ["nowhere.json"]),
    "perplexity tp over the K/V heads": (["perplexity", "--tp", "4", "--cp", "1", "--tokens", "16"],
                                         ["tp = 4: more TP ranks than the checkpoint's num_key_value_heads = 3"]),
    "perplexity checkpoint not one": (["perplexity", "--checkpoint", "docs", "--tokens", "16"],
                                      ["checkpoint = 'docs'", "config.json' does not exist"]),
    "perplexity --tokens 1": (["perplexity", "--tokens", "1"], ["--tokens: expected an integer >= 2, got 1"]),
    "needle-data --seq-len 8": (["needle-data", "data/corpus", "--out", "x", "--seq-len", "8", "--tokenizer", "t"],
                                ["--seq-len: expected an integer >= 64, got 8"]),
}
HUGE = {"cp 10000": {"cp": 10000}, "tp 8 x cp 512": {"tp": 8, "cp": 512}}  # id -> layout sizes
PLAN_JSON = "plan.json"
SIDE_BY_SIDE = max(2, min(4, os.cpu_count() or 2))
"""Commands run at once (each is one process importing torch: CPU-bound)."""


def commands(scratch: Path) -> dict[str, tuple[list[str], float]]:
    """Test name -> (argv of ``megatron-ring``, hard timeout in s); ``scratch`` is a fresh folder."""
    cases: dict[str, tuple[list[str], float]] = {"test_no_command_as_a_process_is_one_line_and_exit_2": ([], 60)}
    for name, sizes in HUGE.items():
        flags = [x for axis, size in sizes.items() for x in (f"--{axis}", str(size))]
        cases[f"test_huge_layout_finishes_and_is_right[{name}]"] = (["layout", *flags], 90)
    not_a_dir = ROOT / "README.md"
    cpu_ring = str(ROOT / "configs" / "deepspeed" / "cpu_ring_cp4.json")
    cases.update({
        "test_calibrate_out_under_a_file_fails_before_measuring": (
            ["calibrate", "--out", str(not_a_dir / "x.json")], 30),
        "test_bench_out_under_a_file_fails_before_measuring": (
            ["bench", "attention", "--L", "256", "--P", "2", "--out", str(not_a_dir / "x.json")], 30),
        "test_sweep_out_dir_under_a_file_fails_before_running": (
            ["sweep", "cpu", "--lengths", "48", "--out-dir", str(not_a_dir / "d")], 30),
        "test_compare_out_dir_under_a_file_fails_before_running": (
            ["compare", "cpu", "--out-dir", str(not_a_dir / "d")], 30),
        "test_perplexity_out_under_a_file_fails_before_running": (
            ["perplexity", "--out", str(not_a_dir / "p.json")], 30),
        "test_plan_markdown_under_a_file_is_a_usage_error": (
            ["plan", cpu_ring, "--markdown", str(not_a_dir / "plan.md")], 60),
        "test_plan_of_a_shipped_config_runs_clean": (["plan", cpu_ring, "--json", str(scratch / PLAN_JSON)], 60),
    })
    return cases


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("probe_cli")


@pytest.fixture(scope="module")
def launched(request: pytest.FixtureRequest, scratch: Path) -> Iterator[dict[str, Future[Outcome]]]:
    """Test name -> the running :func:`run_cli` of its command, for the tests of this module that were
    selected (started on first use, ``SIDE_BY_SIDE`` at a time, in the order the tests run)."""
    cases = commands(scratch)
    selected = [item.name for item in request.session.items
                if item.module is request.module and item.name in cases]
    with ThreadPoolExecutor(max_workers=SIDE_BY_SIDE, thread_name_prefix="probe-cli") as pool:
        futures = {name: pool.submit(run_cli, *cases[name][0], timeout_s=cases[name][1]) for name in selected}
        try:
            yield futures
        finally:
            for future in futures.values():
                future.cancel()


def outcome_of(request: pytest.FixtureRequest, launched: dict[str, Future[Outcome]]) -> Outcome:
    """This test's command's outcome (its failure, a hang or a leftover process, raised here)."""
    assert request.node.name in launched, f"{request.node.name} has no command"
    return launched[request.node.name].result()


@pytest.mark.parametrize("case", list(USAGE))
def test_usage_error_is_one_line_and_exit_2(case: str, capsys: pytest.CaptureFixture) -> None:
    assert_usage_error(run_in_process(USAGE[case][0], capsys), *USAGE[case][1])


def test_no_command_as_a_process_is_one_line_and_exit_2(request: pytest.FixtureRequest, launched) -> None:
    assert_usage_error(outcome_of(request, launched), *USAGE["no command"][1])


@pytest.mark.parametrize("sizes", list(HUGE.values()), ids=list(HUGE))
def test_huge_layout_finishes_and_is_right(sizes: dict[str, int], request: pytest.FixtureRequest, launched) -> None:
    outcome = outcome_of(request, launched)
    assert outcome.code == 0, outcome.err
    layout = ParallelLayout(**sizes)
    rows = [ln.split() for ln in outcome.out.splitlines() if ln.strip() and ln.split()[0].isdigit()]
    assert len(rows) == layout.world_size
    for rank in (0, layout.world_size // 2, layout.world_size - 1):
        prev, nxt = layout.ring_neighbours(rank, "cp")
        assert rows[rank][5:] == [str(prev), "->", str(rank), "->", str(nxt)], rows[rank]
    assert max(map(len, outcome.out.splitlines())) < 400, "a group printed whole"


def test_calibrate_out_under_a_file_fails_before_measuring(request: pytest.FixtureRequest, launched) -> None:
    assert_usage_error(outcome_of(request, launched), "--out")


def test_bench_out_under_a_file_fails_before_measuring(request: pytest.FixtureRequest, launched) -> None:
    assert_usage_error(outcome_of(request, launched), "--out")


def test_sweep_out_dir_under_a_file_fails_before_running(request: pytest.FixtureRequest, launched) -> None:
    assert_usage_error(outcome_of(request, launched), "--out-dir")


def test_compare_out_dir_under_a_file_fails_before_running(request: pytest.FixtureRequest, launched) -> None:
    assert_usage_error(outcome_of(request, launched), "--out-dir")


def test_perplexity_out_under_a_file_fails_before_running(request: pytest.FixtureRequest, launched) -> None:
    assert_usage_error(outcome_of(request, launched), "--out")


def test_plan_markdown_under_a_file_is_a_usage_error(request: pytest.FixtureRequest, launched) -> None:
    assert_usage_error(outcome_of(request, launched), "--markdown")


def test_plan_of_a_shipped_config_runs_clean(request: pytest.FixtureRequest, launched, scratch: Path) -> None:
    out = outcome_of(request, launched)
    assert out.code == 0, out.err
    assert_clean(out.err)
    assert (scratch / PLAN_JSON).read_text().startswith("{")
