"""RingTrainer's batch handling in one process: next-token targets, the right-padding collator, and the
example's bad arguments refused before any process group (tests/integration/test_hf_trainer.py trains)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from megatron_ring.integrations.hf.trainer import IGNORE, next_token_targets, right_padding_collator  # noqa: E402
from megatron_ring.training.hf_trainer import trainer_main  # noqa: E402


def test_collator_pads_on_the_right_and_targets_are_the_next_labels() -> None:
    batch = right_padding_collator(pad_id=9)([{"input_ids": [1, 2, 3, 4]}, {"input_ids": [5, 6], "labels": [IGNORE, 6]}])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 4], [5, 6, 9, 9]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch["labels"].tolist() == [[1, 2, 3, 4], [IGNORE, 6, IGNORE, IGNORE]]
    assert next_token_targets(batch).tolist() == [[2, 3, 4, IGNORE], [6, IGNORE, IGNORE, IGNORE]]
    no_labels = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    assert next_token_targets(no_labels).tolist() == [[2, 3, 4, IGNORE], [6, IGNORE, IGNORE, IGNORE]]


@pytest.mark.parametrize("change, message", [
    ({"attention_mask": torch.tensor([[0, 1, 1]])}, "left padding"),
    ({"position_ids": torch.tensor([[0, 1, 0]])}, "position_ids"),
    ({"labels": torch.tensor([[1, 2]])}, "labels"),
    ({"input_ids": torch.tensor([1, 2, 3])}, "2-D"),
])
def test_unsupported_batches_are_refused(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        next_token_targets({"input_ids": torch.tensor([[1, 2, 3]]), **change})


@pytest.mark.parametrize("argv, message", [
    (["--attention", "flash"], "--attention 'flash'; allowed: ring, sdpa, eager"),
    (["--attention", "sdpa", "--cp", "2"], "allowed: cp 1"),
    (["--no_such_flag", "1"], "unknown arguments"),
])
def test_example_refuses_bad_arguments_before_starting(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                       argv: list[str], message: str) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert trainer_main(["--model", str(tmp_path), "--output_dir", str(tmp_path / "out"), *argv]) == 2
    assert message in capsys.readouterr().err


def test_example_refuses_a_folder_without_a_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert trainer_main(["--model", str(tmp_path), "--output_dir", str(tmp_path / "out")]) == 2
    assert "not a transformers checkpoint folder" in capsys.readouterr().err
