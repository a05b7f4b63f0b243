"""Text prompts that the ranks would refuse after loading the model are refused before any rank starts
(``megatron-ring check``, ``megatron-ring compare``), naming workload.text: a chat template the tokenizer
lacks, a prompt_len without room for the document, a document too short for a runner without padding."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from megatron_ring.check import check_main  # noqa: E402
from megatron_ring.inference.compare import compare_main  # noqa: E402
from megatron_ring.testing.tiny_hf import save_tiny_model  # noqa: E402

pytestmark = [pytest.mark.integration]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))  # its byte tokenizer has no chat template


def config(folder: Path, name: str, model: dict[str, Any], *, prompt_len: int, chat: bool, question: str,
           cp: int = 1) -> Path:
    (folder / "doc.txt").write_text("a short document")
    (folder / "docs.jsonl").write_text(json.dumps({"document_file": "doc.txt", "question": question}) + "\n")
    path = folder / f"{name}.json"
    path.write_text(json.dumps({"dtype": "fp32", "replace_with_kernel_inject": False, "megatron_ring": {
        "model": model, "layout": {"cp": cp},
        "workload": {"batch": 1, "prompt_len": prompt_len, "new_tokens": 2,
                     "text": {"jsonl": "docs.jsonl", "chat_template": chat}}}}))
    return path


CASES = {
    "no chat template": ("hf", dict(prompt_len=64, chat=True, question="Why?"), "has no chat template"),
    "no room for the document": ("hf", dict(prompt_len=8, chat=False, question="What does the text above say?"),
                                 "leaves no room for the document"),
    "megatron cannot pad": ("megatron", dict(prompt_len=64, chat=False, question="Why?", cp=2),
                            "takes no padding; give a document of at least 58 tokens"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_check_refuses_before_any_rank(tmp_path, capsys, checkpoint, name) -> None:
    runner, sizes, expected = CASES[name]
    model = {"runner": "hf", "config": {"checkpoint": checkpoint}} if runner == "hf" else \
        {"runner": "megatron", "config": {"checkpoint": checkpoint, "dtype": "fp32", "attention": "ring",
                                          "parallel": {"cp": 2}}}
    path = config(tmp_path, "c", model, **sizes)
    assert check_main([str(path)]) == 2
    err = capsys.readouterr().err
    assert "workload.text" in err and expected in err, err


def test_compare_refuses_before_launching(tmp_path, capsys, checkpoint) -> None:
    model = {"runner": "hf", "config": {"checkpoint": checkpoint}}
    base = config(tmp_path, "base", model, prompt_len=64, chat=True, question="Why?")
    ring = config(tmp_path, "ring", model, prompt_len=64, chat=True, question="Why?", cp=2)
    out = tmp_path / "out"
    assert compare_main([str(base), str(ring), "--out-dir", str(out), "--launcher", "torchrun"]) == 2
    assert "has no chat template" in capsys.readouterr().err
    assert not list(out.glob("*.log")), "no run may start"


def test_a_launched_rank_refuses_before_loading_its_model(tmp_path, capsys, checkpoint, monkeypatch) -> None:
    """A rank a launcher started directly (no check, no compare before it) builds the text prompts with the
    tokenizer alone, before any process group or model: exit 2 naming workload.text."""
    from megatron_ring.inference.main import infer_main

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    path = config(tmp_path, "c", {"runner": "hf", "config": {"checkpoint": checkpoint}}, prompt_len=64, chat=True,
                  question="Why?")
    assert infer_main(["--deepspeed_config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "workload.text" in err and "has no chat template" in err, err
