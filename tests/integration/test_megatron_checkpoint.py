"""The megatron runner on transformers checkpoints: Llama, Qwen2, Mistral converted into Megatron-core's GPTModel.

Single rank: the converted model's logits equal transformers' within 1e-5 (fp32), with Q/K/V bias,
tied embeddings, sliding windows and scaled RoPE, each of which changes the logits. Gloo ranks:
greedy tokens of the megatron runner at cp 2, cp 4, tp 2, pp 2 and tp 2 x pp 2 equal single-process
``generate`` on a tiny random checkpoint that transformers writes in the test.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

from megatron_ring.attention.reference import rel_err  # noqa: E402
from megatron_ring.testing.tiny_hf import VOCAB_SIZE, save_tiny_model, tiny_model  # noqa: E402
from tests.integration import megatron_checkpoint_workers as workers  # noqa: E402
from tests.integration.hf_runner_workers import reference  # noqa: E402
from tests.integration.megatron_workers import generate_with_runner  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.pool_family("frameworks")]
TOL = 1e-5
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
CASES = {  # name: (family, overrides, the overrides without the feature under test: must change the logits)
    "llama": ("llama", {}, None),
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}, None),
    "mistral-window8": ("mistral", {"sliding_window": 8}, {"sliding_window": None}),
    "qwen2-window8": ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0},
                      {"use_sliding_window": False}),
    "llama-rope-linear": ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}},
                          {"rope_parameters": {"rope_theta": 10000.0}}),
    "llama-rope-llama3": ("llama", {"rope_parameters": LLAMA3}, {"rope_parameters": {"rope_theta": 500000.0}}),
}


def _ids(batch: int = 2, length: int = 40, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(CASES))
def test_converted_logits_equal_transformers(gloo_pool: Any, name: str) -> None:
    family, overrides, without = CASES[name]
    ids = _ids()
    with torch.no_grad():
        expected = tiny_model(family, **overrides)(ids).logits
    ours = gloo_pool(1).run(workers.converted_logits, family, overrides, ids)[0]
    err = rel_err(ours, expected)
    assert err <= TOL, f"{name}: rel err {err:.2e}"
    if without is not None:
        with torch.no_grad():
            plain = tiny_model(family, **{**overrides, **without})(ids).logits
        assert rel_err(plain, expected) > 100 * TOL, f"{name}: the feature does not change the logits"


def test_megatrons_own_attention_too(gloo_pool: Any) -> None:
    """attention: local (Megatron's DotProductAttention) on the converted Qwen2 with its window."""
    family, overrides, _ = CASES["qwen2-window8"]
    ids = _ids()
    with torch.no_grad():
        expected = tiny_model(family, **overrides)(ids).logits
    ours = gloo_pool(1).run(workers.converted_logits, family, overrides, ids, "local")[0]
    assert rel_err(ours, expected) <= TOL


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """Tiny random checkpoints written by transformers: Llama; Qwen2 with tied embeddings; Mistral with a window."""
    return {name: save_tiny_model(family, tmp_path_factory.mktemp(name), **overrides)
            for name, (family, overrides) in {"llama": ("llama", {}),
                                              "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
                                              "mistral-window8": ("mistral", {"sliding_window": 8})}.items()}


PROMPT_LEN, NEW_TOKENS, SEED = 32, 6, 7
GREEDY = {  # name: (checkpoint, attention, layout)
    "llama-cp2": ("llama", "ring", {"cp": 2}),
    "llama-cp4": ("llama", "ring", {"cp": 4}),
    "llama-tp2": ("llama", "sdpa", {"tp": 2}),
    "llama-pp2": ("llama", "sdpa", {"pp": 2}),
    "llama-tp2-pp2": ("llama", "sdpa", {"tp": 2, "pp": 2}),
    "qwen2-tied-tp2-pp2": ("qwen2-tied", "sdpa", {"tp": 2, "pp": 2}),
    "qwen2-tied-cp2": ("qwen2-tied", "ring", {"cp": 2}),
    "mistral-window8-cp2": ("mistral-window8", "ring", {"cp": 2}),
    "mistral-window8-tp2": ("mistral-window8", "sdpa", {"tp": 2}),
}


@pytest.mark.parametrize("name", list(GREEDY))
def test_runner_tokens_equal_generate(gloo_pool: Any, checkpoints: dict[str, str], name: str) -> None:
    from megatron_ring.parallel.layout import ParallelLayout

    which, attention, sizes = GREEDY[name]
    layout = ParallelLayout(**sizes)
    model = {"checkpoint": checkpoints[which], "dtype": "fp32", "attention": attention, "parallel": sizes}
    per_rank = gloo_pool(layout.world_size).run(generate_with_runner, model, layout, batch=2, prompt_len=PROMPT_LEN,
                                                new_tokens=NEW_TOKENS, seed=SEED, timeout_s=300)
    prompt = torch.randint(0, VOCAB_SIZE, (2, PROMPT_LEN), generator=torch.Generator().manual_seed(SEED))
    # An explicit mask: generate would take the random prompt's <pad> ids (258) for padding.
    expected = reference(checkpoints[which], prompt, torch.ones_like(prompt), NEW_TOKENS).tolist()
    assert len(set(expected[0])) > 1, "degenerate generation"
    for rank, tokens in enumerate(per_rank):
        assert tokens == expected, f"{name} rank {rank}: {tokens} != {expected}"


def test_check_model_reads_the_checkpoints_config(tmp_path) -> None:
    """Validation before anything is built: sizes from config.json, rules against the layout, refusals by name."""
    from megatron_ring.config import ConfigError
    from megatron_ring.inference.runners.gpt import check_model, takes_text
    from megatron_ring.parallel.layout import ParallelLayout
    from megatron_ring.testing.tiny_hf import tiny_config

    path = str(tmp_path / "llama")
    tiny_config("llama").save_pretrained(path)
    model = {"checkpoint": path, "dtype": "fp32", "attention": "ring", "parallel": {"cp": 2}}
    summary = check_model(model, ParallelLayout(cp=2), batch=1, prompt_len=32, new_tokens=4, dtype="fp32")
    norms = 64 * (2 * 2 + 1)
    assert summary["checkpoint"] == path and summary["activation"] == "swiglu" and summary["num_query_groups"] == 2
    assert summary["parameters"] == sum(p.numel() for p in tiny_model("llama").parameters()) - norms
    assert takes_text(model) and not takes_text({"model": {}})
    with pytest.raises(ConfigError, match=r"model.num_query_groups = 2 is not divisible by parallel.tp = 4"):
        tp4 = {**model, "attention": "sdpa", "parallel": {"tp": 4}}
        check_model(tp4, ParallelLayout(tp=4), batch=1, prompt_len=32, new_tokens=4, dtype="fp32")
    with pytest.raises(ConfigError, match=r"32 \+ 600 - 1 = 631 exceeds model.seq_length = 512"):
        check_model(model, ParallelLayout(cp=2), batch=1, prompt_len=32, new_tokens=600, dtype="fp32")
    gemma = str(tmp_path / "gemma2")
    tiny_config("gemma2").save_pretrained(gemma)
    with pytest.raises(ConfigError, match=r"checkpoint = '.*gemma2': model_type = 'gemma2' .* allowed: llama"):
        check_model({**model, "checkpoint": gemma}, ParallelLayout(cp=2), batch=1, prompt_len=32, new_tokens=4,
                    dtype="fp32")
    with pytest.raises(ConfigError, match=r"checkpoint = '/nowhere': '/nowhere' does not exist"):
        check_model({**model, "checkpoint": "/nowhere"}, ParallelLayout(cp=2), batch=1, prompt_len=32, new_tokens=4,
                    dtype="fp32")


def test_text_prompts_need_a_checkpoint(tmp_path) -> None:
    """workload.text is accepted for the megatron runner with a checkpoint (its tokenizer), refused without."""
    from megatron_ring.config import ConfigError, load_mapping
    from megatron_ring.inference.schema import validate
    from megatron_ring.testing.tiny_hf import tiny_config

    path = str(tmp_path / "llama")
    tiny_config("llama").save_pretrained(path)
    (tmp_path / "d.txt").write_text("a document")
    ring = {"layout": {"cp": 2}, "workload": {"batch": 1, "prompt_len": 16, "new_tokens": 2, "text": {"files": ["d.txt"]}},
            "model": {"runner": "megatron", "config": {"checkpoint": path, "dtype": "fp32", "parallel": {"cp": 2}}}}
    validate(ring, {}, world_size=2, dtype="fp32", path=tmp_path / "c.json")
    tiny = load_mapping(Path(__file__).resolve().parents[2] / "configs" / "megatron" / "tiny_ring_cp2.yaml")
    with pytest.raises(ConfigError, match="workload.text needs a model with a tokenizer"):
        validate({**ring, "model": {"runner": "megatron", "config": tiny}}, {}, world_size=2, dtype="fp32",
                 path=tmp_path / "c.json")
