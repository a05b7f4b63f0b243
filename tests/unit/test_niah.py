"""``megatron-ring niah`` without ranks: needle prompts fitted to exact lengths, scoring and the cell-by-cell
comparison, and every bad input refused before any rank starts, naming its flag or field (a tiny random
Llama with a byte tokenizer saved to a temporary folder; its window is 512 tokens)."""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from megatron_ring.eval.needle_prompts import needle_cell, needle_grid  # noqa: E402
from megatron_ring.eval.niah import niah_main  # noqa: E402
from megatron_ring.eval.niah_report import compare_cells, score  # noqa: E402
from megatron_ring.datasets.needle import paragraphs_of  # noqa: E402
from megatron_ring.runtime.folder_lock import LOCK_FILE  # noqa: E402
from megatron_ring.testing.configs import hf_inference_config  # noqa: E402
from megatron_ring.testing.tiny_hf import byte_tokenizer, save_tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TEXTS = [(ROOT / "data" / "corpus" / name).read_text() for name in ("BSD.txt", "MPL-2.0.txt")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("niah")
    return hf_inference_config(folder / "tiny_cp2.json", save_tiny_model("llama", folder / "llama"), cp=2)


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str]:
    code = niah_main([*map(str, argv), "--no-chat-template", "--texts", str(ROOT / "data" / "corpus" / "BSD.txt")])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_a_cell_is_exactly_its_length_with_the_whole_needle_at_its_depth(depth: float) -> None:
    tok = byte_tokenizer()
    tok.chat_template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    cell = needle_cell(paragraphs_of(TEXTS), tok, length=400, depth=depth, seed=3, chat=True)
    assert len(cell.ids) == 400
    needle = tok(cell.needle, add_special_tokens=False)["input_ids"]
    assert cell.ids[cell.needle_at:cell.needle_at + len(needle)] == needle
    assert cell.value in cell.needle and cell.key in cell.question
    assert abs(cell.actual_depth - depth) < 0.01
    assert tok.decode(cell.ids).endswith(f"{cell.question}>")


def test_cells_are_the_same_in_any_grid_and_differ_between_cells() -> None:
    tok = byte_tokenizer()
    grid = needle_grid(TEXTS, tok, lengths=[300, 400], depths=[0.0, 0.5], seed=0, chat=False)
    alone = needle_grid(TEXTS, tok, lengths=[400], depths=[0.5], seed=0, chat=False)
    assert grid[3] == alone[0]
    assert len({cell.value for cell in grid}) == 4


def test_scoring_and_the_cell_by_cell_comparison() -> None:
    assert score("The special magic number for the silver harbor is 614207.", "614207") == 1
    assert score("The special magic number for the silver harbor is", "614207") == 0
    cell = {"length": 8, "depth": 0.5, "ids_digest": "a", "answer": "x 1", "generated_ids": [1], "score": 1}
    ours = {"grid": {"lengths": [8], "depths": [0.5]}, "cells": [cell]}
    assert compare_cells(ours, json.loads(json.dumps(ours))) == []
    other = {**ours, "cells": [{**cell, "answer": "x 2", "generated_ids": [2], "score": 0}]}
    assert [p.split(":")[1].split()[0] for p in compare_cells(ours, other)] == ["answer", "generated_ids", "score"]


def test_bad_lengths_are_refused_naming_the_flag(tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "out"
    code, err = run(capsys, tiny, "--lengths", "1024", "--new-tokens", "8", "--out", out)
    assert code == 2 and "--lengths 1024: length + --new-tokens - 1 = 1031 exceeds the checkpoint's " \
        "max_position_embeddings = 512" in err, err
    code, err = run(capsys, tiny, "--lengths", "258", "--out", out)
    assert code == 2 and "--lengths 258 is not divisible by 2*cp = 4" in err, err
    code, err = run(capsys, tiny, "--lengths", "96", "--out", out)
    assert code == 2 and "--lengths [96]: too short for a needle" in err, err
    assert not out.exists() or not any(out.iterdir()), "nothing was written for a refused run"


def test_bad_depths_and_texts_are_refused(tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as stop:
        niah_main([str(tiny), "--depths", "0", "1.5"])
    assert stop.value.code == 2 and "argument --depths: expected a depth in [0, 1]" in capsys.readouterr().err
    code = niah_main([str(tiny), "--lengths", "256", "--no-chat-template", "--texts", str(tmp_path / "none"),
                      "--out", str(tmp_path / "out")])
    assert code == 2 and "--texts entry" in capsys.readouterr().err
    code = niah_main([str(tiny), "--lengths", "256", "--out", str(tmp_path / "o")])
    assert code == 2 and "pass --no-chat-template" in capsys.readouterr().err  # the byte tokenizer has none


def test_configs_that_cannot_serve_a_needle_are_refused(tiny: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture) -> None:
    code, err = run(capsys, ROOT / "configs" / "deepspeed" / "train_cp2.json", "--lengths", "256")
    assert code == 2 and "is not an inference config" in err, err
    code, err = run(capsys, ROOT / "configs" / "deepspeed" / "cpu_ring_cp4.json", "--lengths", "64")
    assert code == 2 and "serves random weights without a tokenizer" in err, err
    checkpoint = json.loads(tiny.read_text())["megatron_ring"]["model"]["config"]["checkpoint"]
    wide = hf_inference_config(tmp_path / "tp4.json", checkpoint, tp=4)
    code, err = run(capsys, wide, "--lengths", "256")
    assert code == 2 and "megatron_ring.layout.tp = 4: more TP ranks than the checkpoint's num_key_value_heads" in err


def test_a_busy_folder_and_another_grid_are_refused(tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / LOCK_FILE).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "command": "x"}))
    code, err = run(capsys, tiny, "--lengths", "256", "--out", busy)
    assert code == 2 and f"--out = {str(busy)!r} is in use by another run" in err, err
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"schema": "megatron_ring.eval.niah/1", "grid": {"lengths": [512]}}))
    code, err = run(capsys, tiny, "--lengths", "256", "--out", tmp_path / "o", "--compare-to", other)
    assert code == 2 and "--compare-to" in err and "another grid (lengths [512] vs [256]" in err, err
