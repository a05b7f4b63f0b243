"""``megatron-ring niah`` end to end on a tiny grid (2 lengths x 2 depths): the grid at cp 1, then at cp 2
with ``--compare-to`` the cp 1 result, each ONE job under torchrun (a tiny random Llama with a byte
tokenizer, saved to a temporary folder: the answers are noise, but both layouts must produce the same
noise, token for token). The command runs in this process, its ranks under the real launcher."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.launcher]
NEEDS = ("transformers", "deepspeed", "matplotlib")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in NEEDS), reason=f"needs {', '.join(NEEDS)}")
def test_niah_at_cp2_writes_its_heatmap_and_equals_cp1_cell_by_cell(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture) -> None:
    from megatron_ring.eval.niah import niah_main
    from megatron_ring.testing.configs import hf_inference_config
    from megatron_ring.testing.tiny_hf import save_tiny_model

    checkpoint = save_tiny_model("llama", tmp_path / "llama")
    grid = ["--lengths", "192", "256", "--depths", "0", "0.5", "--new-tokens", "4", "--no-chat-template",
            "--launcher", "torchrun", "--texts", str(ROOT / "data" / "corpus" / "BSD.txt")]
    results = {}
    for cp in (1, 2):
        config = hf_inference_config(tmp_path / f"tiny_cp{cp}.json", checkpoint, cp=cp)
        compare = ["--compare-to", str(tmp_path / "cp1" / "niah.json")] if cp == 2 else []
        code = niah_main([str(config), *grid, "--out", str(tmp_path / f"cp{cp}"), *compare])
        printed = capsys.readouterr()
        assert code == 0, printed.out[-3000:] + printed.err[-3000:]
        results[cp] = json.loads((tmp_path / f"cp{cp}" / "niah.json").read_text())
        assert (tmp_path / f"cp{cp}" / "heatmap.png").stat().st_size > 0
        assert not (tmp_path / f"cp{cp}" / "niah_prompts.json").exists()
    assert "cell by cell identical to" in printed.out
    assert results[2]["layout"]["cp"] == 2 and results[1]["layout"]["cp"] == 1
    cells = {cp: [(c["length"], c["depth"], c["tokens"], c["ids_digest"], c["generated_ids"], c["answer"], c["score"])
                  for c in results[cp]["cells"]] for cp in (1, 2)}
    assert [c[:3] for c in cells[1]] == [(192, 0.0, 192), (192, 0.5, 192), (256, 0.0, 256), (256, 0.5, 256)]
    assert cells[1] == cells[2]
    assert all(len(c["generated_ids"]) == 4 and c["seconds"] > 0 for c in results[2]["cells"])
