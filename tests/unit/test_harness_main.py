"""One rank's lm-eval command line: the shipped tasks on the include path, the writers on rank 0 alone."""
from __future__ import annotations

from megatron_ring.eval.harness_main import LAUNCHER_FLAGS, TASKS_DIR, WRITERS, with_shipped_tasks, without_flags


def test_shipped_tasks_join_the_include_path() -> None:
    assert with_shipped_tasks(["--tasks", "x"]) == ["--tasks", "x", "--include_path", str(TASKS_DIR)]
    assert with_shipped_tasks(["--include_path", "/mine", "--tasks", "x"]) == [
        "--include_path", f"/mine:{TASKS_DIR}", "--tasks", "x"]
    assert with_shipped_tasks(["--include_path=/mine"]) == [f"--include_path=/mine:{TASKS_DIR}"]
    assert {p.name for p in TASKS_DIR.glob("*.yaml")} == {"ring_passkey.yaml", "ring_needle_choice.yaml",
                                                          "ring_corpus_ppl.yaml"}


def test_other_ranks_drop_the_flags_that_write() -> None:
    argv = ["--model", "megatron_ring", "--output_path", "out", "--log_samples", "--tasks", "a",
            "-o=x", "-s", "--limit", "2"]
    assert without_flags(argv, WRITERS) == ["--model", "megatron_ring", "--tasks", "a", "--limit", "2"]


def test_the_deepspeed_launchers_local_rank_is_not_passed_to_lm_eval() -> None:
    assert without_flags(["--local_rank=1", "--tasks", "a"], LAUNCHER_FLAGS) == ["--tasks", "a"]
    assert without_flags(["--local_rank", "1", "--tasks", "a"], LAUNCHER_FLAGS) == ["--tasks", "a"]
