"""``megatron-ring lm-eval``: bad input is named before any rank starts (exit 2, no log); a good run launches
tp * cp * pp ranks under torchrun and rank 0 alone writes lm-eval's results."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

from megatron_ring.eval.harness_cli import harness_cli_main  # noqa: E402
from megatron_ring.testing.tiny_hf import save_tiny_model  # noqa: E402
from tests.integration.test_harness_model import short_paragraphs  # noqa: E402

pytestmark = [pytest.mark.integration]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[str, str]:
    folder = tmp_path_factory.mktemp("harness-cli")
    return save_tiny_model("llama", folder / "tiny"), short_paragraphs(folder / "hay.txt")


def metadata(texts: str, lengths: list[int]) -> str:
    return json.dumps({"max_seq_lengths": lengths, "depths": [0.0], "texts": texts})


@pytest.mark.parametrize("model_args, tasks, lengths, expected", [
    ("max_length=512", "ring_passkey", [384, 600], "document 1: a generate_until request of"),
    ("max_length=512", "ring_needle_choice", [600], "a loglikelihood request of"),
    ("max_length=1024", "ring_passkey", [384], "max_length = 1024 exceeds the model's window of 512"),
    ("cpp=2", "ring_passkey", [384], "unknown key 'cpp'"),
    ("tp=8", "ring_passkey", [384], "allowed: tp <= 4"),
    ("batch_size=auto", "ring_passkey", [384], "batch_size = 'auto'"),
    ("runner=toy", "ring_passkey", [384], "runner"),
    ("max_length=512", "ring_no_such_task", [384], "ring_no_such_task"),
], ids=["task-over-window", "choice-over-window", "max-length", "unknown-key", "tp-vs-heads", "auto-batch",
        "toy-runner", "unknown-task"])
def test_bad_input_is_named_before_any_rank(tiny, tmp_path, capsys, model_args, tasks, lengths, expected) -> None:
    checkpoint, texts = tiny
    code = harness_cli_main(["--model_args", f"checkpoint={checkpoint},{model_args}", "--tasks", tasks,
                             "--metadata", metadata(texts, lengths), "--output_path", str(tmp_path / "out")])
    assert code == 2
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "out").exists(), "nothing may start (or be written) on bad input"


def test_megatron_runner_needs_a_max_length_the_ring_can_shard(tiny, capsys) -> None:
    checkpoint, texts = tiny
    code = harness_cli_main(["--model_args", f"checkpoint={checkpoint},runner=megatron,cp=2,max_length=510",
                             "--tasks", "ring_passkey", "--metadata", metadata(texts, [384])])
    assert code == 2 and "multiple of 2 * cp = 4" in capsys.readouterr().err


@pytest.mark.launcher
def test_cp2_under_torchrun_writes_results_once(tiny, tmp_path, capsys) -> None:
    checkpoint, texts = tiny
    out = tmp_path / "out"
    code = harness_cli_main(["--model_args", f"checkpoint={checkpoint},max_length=512,cp=2", "--tasks",
                             "ring_corpus_ppl", "--metadata", metadata(texts, [512]), "--output_path", str(out),
                             "--log_samples"])
    printed = capsys.readouterr().out
    assert code == 0, printed[-3000:] + (out / "lm_eval.log").read_text()[-3000:]
    assert "ring_corpus_ppl" in printed and "2 processes via torchrun" in printed
    results = list(out.rglob("results_*.json"))
    assert len(results) == 1, f"one results file, by rank 0: {results}"
    assert json.loads(results[0].read_text())["results"]["ring_corpus_ppl"]["word_perplexity,none"] > 0
