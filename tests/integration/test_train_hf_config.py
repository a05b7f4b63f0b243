"""The ``transformers`` entry of a training config: every mistake named before anything starts."""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

from megatron_ring.config import ConfigError  # noqa: E402
from megatron_ring.training.schema import load_train_spec, parse_train_spec  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ROOT / "configs" / "deepspeed" / "train_hf_cp2.json"


def good() -> dict[str, Any]:
    return json.loads(SHIPPED.read_text())


def problems_of(raw: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as err:
        parse_train_spec(raw, world_size=4, base_dir=SHIPPED.parent)
    return str(err.value)


def with_section(**changes: Any) -> dict[str, Any]:
    raw = good()
    section = raw["megatron_ring"]
    for key, value in changes.items():
        if value is None:
            section.pop(key, None)
        else:
            section[key] = value
    return raw


def with_model(**changes: Any) -> dict[str, Any]:
    raw = good()
    raw["megatron_ring"]["transformers"].update(changes)
    return raw


def with_model_config(**changes: Any) -> dict[str, Any]:
    raw = good()
    raw["megatron_ring"]["transformers"]["config"].update(changes)
    return raw


def test_shipped_config_builds_the_llama_config() -> None:
    spec = load_train_spec(SHIPPED, world_size=4)
    assert spec.model is None and spec.transformers.model_type == "llama" and spec.vocab_size == 128


BAD = {
    "both models": (with_section(model="../megatron/tiny_ring_cp2.yaml"), ["exactly one of 'model'"]),
    "no model": (with_section(transformers=None), ["exactly one of 'model'"]),
    "checkpoint absent": (with_model(checkpoint="nowhere"), ["transformers.checkpoint = 'nowhere'", "does not exist"]),
    "no model given": (with_model(config=None), ["give 'config'", "'checkpoint'"]),
    "gguf without checkpoint": (with_model(gguf_file="a.gguf"), ["gguf_file / cache_dir need"]),
    "model type": (with_model_config(model_type="lama"), ["config.model_type = 'lama'", "did you mean 'llama'"]),
    "config key": (with_model_config(hiden_size=32), ["config.hiden_size: unknown to LlamaConfig",
                                                       "did you mean 'hidden_size'"]),
    "attention": (with_model(attention="flash"), ["transformers.attention", "'flash'", "'ring'"]),
    "sdpa at cp 2": (with_model(attention="sdpa"), ["attention = 'sdpa' with layout.cp = 2", "allowed: 'ring'"]),
    "small vocabulary": (with_model_config(vocab_size=64), ["vocab_size = 64", "at least 128"]),
    "not a causal LM": (with_model(config={"model_type": "t5"}), ["model_type = 't5': transformers has no causal LM"]),
    "an encoder": (with_model(config={"model_type": "bert"}), ["model_type = 'bert' is an encoder",
                                                                "is_decoder: true"]),
    "heads vs hidden": (with_model_config(num_attention_heads=5), ["LlamaConfig rejects it",
                                                                    "not a multiple of the number of attention heads"]),
    "positions": (with_model_config(max_position_embeddings=64), ["megatron_ring.seq_len = 128: more than the "
                                                                  "transformers model's max_position_embeddings = 64"]),
    "attention dropout": (with_model_config(attention_dropout=0.1), ["attention_dropout = 0.1", "allowed: 0.0"]),
    "tensor parallel": (with_section(layout={"tp": 2, "cp": 2, "dp": 1}), ["layout.tp = 2", "allowed: 1"]),
    "megatron attention": (with_section(attention="ring"), ["megatron_ring.attention = 'ring'",
                                                            "megatron_ring.transformers.attention instead"]),
    "section key": (with_model(atention="ring"), ["atention", "attention"]),
    "no checkpoint": (with_model(config=None, checkpoint="."), ["checkpoint = '.'", "no config.json"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_transformers_entry_names_the_field(case: str) -> None:
    raw, needles = BAD[case]
    if case == "tensor parallel":
        raw["train_batch_size"] = 4  # dp = 1
    text = problems_of(copy.deepcopy(raw))
    for needle in needles:
        assert needle in text, f"{needle!r} not in: {text}"


def test_local_checkpoint_is_loaded(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    spec = load_train_spec(SHIPPED, world_size=4)
    AutoModelForCausalLM.from_config(spec.transformers).save_pretrained(tmp_path)
    raw = with_model(config=None, checkpoint=str(tmp_path))
    loaded = parse_train_spec(raw, world_size=4, base_dir=SHIPPED.parent)
    assert loaded.transformers.hidden_size == spec.transformers.hidden_size
    (tmp_path / "model.safetensors").unlink()  # config.json left alone: refused before start, not at load
    with pytest.raises(ConfigError, match="transformers.checkpoint = .* holds config.json but no weights"):
        parse_train_spec(raw, world_size=4, base_dir=SHIPPED.parent)


def test_pretrained_config_fields_are_overridden(tmp_path: Path) -> None:
    """``config`` next to ``checkpoint`` overrides fields of the checkpoint's config: RoPE scaling keeps the
    checkpoint's rope_theta; a misspelt field gets a did-you-mean; a field that shapes the weights is refused."""
    from transformers import AutoModelForCausalLM

    spec = load_train_spec(SHIPPED, world_size=4)
    spec.transformers.rope_parameters = {"rope_type": "default", "rope_theta": 50000.0}
    AutoModelForCausalLM.from_config(spec.transformers).save_pretrained(tmp_path)
    rope = {"rope_type": "linear", "factor": 2.0}
    raw = with_model(checkpoint=str(tmp_path), config={"rope_scaling": rope, "max_position_embeddings": 1024})
    loaded = parse_train_spec(raw, world_size=4, base_dir=SHIPPED.parent).transformers
    assert loaded.rope_parameters == {**rope, "rope_theta": 50000.0} and loaded.max_position_embeddings == 1024
    text = problems_of(with_model(checkpoint=str(tmp_path), config={"rope_scalng": rope, "hidden_size": 32}))
    assert "config.rope_scalng: unknown to the checkpoint's LlamaConfig (did you mean 'rope_scaling'?)" in text
    assert "config.hidden_size = 32: the checkpoint's weights fix it at 64" in text
