"""One rank's lm-eval command line: the shipped tasks on the include path, the writers on rank 0 alone."""
from __future__ import annotations

from megatron_ring.eval.harness_main import TASKS_DIR, with_shipped_tasks, without_writers


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
    assert without_writers(argv) == ["--model", "megatron_ring", "--tasks", "a", "--limit", "2"]
