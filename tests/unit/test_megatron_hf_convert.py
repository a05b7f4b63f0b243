"""The checkpoint converter's pure half: transformers configs -> GPT model fields, tensors -> Megatron's names.

Every refusal names the field or tensor, its value and what is allowed (the conversion itself,
against transformers' logits, is tests/integration/test_megatron_checkpoint.py).
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from megatron_ring.config import ConfigError  # noqa: E402
from megatron_ring.config.gpt import GPTCheckpointConfig, GPTConfig, parse_model_file  # noqa: E402
from megatron_ring.integrations.megatron.hf_config import model_fields  # noqa: E402
from megatron_ring.integrations.megatron.hf_weights import HFWeights, fused_qkv  # noqa: E402
from megatron_ring.testing.tiny_hf import tiny_config, tiny_model  # noqa: E402


def config(family: str = "llama", **overrides: Any) -> dict[str, Any]:
    return tiny_config(family, **overrides).to_dict()


def test_fields_of_each_family() -> None:
    llama = model_fields(config("llama"))
    assert llama == {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "head_dim": 16,
                     "num_query_groups": 2, "ffn_hidden_size": 128, "vocab_size": 260, "seq_length": 512,
                     "position_embedding": "rope", "normalization": "RMSNorm", "norm_epsilon": 1e-6,
                     "activation": "swiglu", "add_bias_linear": False, "add_qkv_bias": False,
                     "tie_embeddings": False, "rotary_base": 10000}
    assert model_fields(config("qwen2", tie_word_embeddings=True)) == {**llama, "add_qkv_bias": True,
                                                                       "tie_embeddings": True}
    assert model_fields(config("mistral", sliding_window=8))["window_size"] == [7, 0]
    linear = model_fields(config(rope_parameters={"rope_type": "linear", "rope_theta": 5e5, "factor": 4}))
    assert linear["rotary_base"] == 500000 and linear["rope_scaling"] == {"type": "linear", "factor": 4.0}
    GPTConfig.parse({"model": linear, "dtype": "fp32"})  # the fields are a valid model section


LLAMA3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
REFUSALS = {  # name: (family, overrides, message)
    "architecture": ("gemma2", {}, r"model_type = 'gemma2' .* allowed: llama, qwen2, mistral"),
    "rope-yarn": ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
                  r"rope_type = 'yarn' cannot be built .* allowed: default, linear, llama3"),
    "rope-dynamic": ("llama", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
                     r"rope_type = 'dynamic'"),
    "rope-llama3-context": ("llama", {"rope_parameters": {**LLAMA3, "original_max_position_embeddings": 4096}},
                            r"original_max_position_embeddings = 4096 .* fixes it to 8192"),
    "rope-partial": ("llama", {"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.5}},
                     r"partial_rotary_factor = 0.5 .* allowed: 1.0"),
    "rope-theta": ("llama", {"rope_parameters": {"rope_theta": 1e4 + 0.5}}, r"rope_theta = 10000.5"),
    "activation": ("llama", {"hidden_act": "gelu"}, r"hidden_act = 'gelu' .* allowed: 'silu'"),
    "attention-bias": ("llama", {"attention_bias": True}, r"attention_bias = True .* allowed: False"),
    "some-layers-slide": ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
                          r"layer_types = \['full_attention', 'sliding_attention'\]: a sliding window on some "
                          r"layers only"),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_what_cannot_be_converted_is_refused_by_name(name: str) -> None:
    family, overrides, message = REFUSALS[name]
    with pytest.raises(ValueError, match=message):
        model_fields(config(family, **overrides))


def test_fused_qkv_is_per_query_group() -> None:
    """4 query heads over 2 groups, head_dim 1: [q0 q1 k0 v0 | q2 q3 k1 v1]."""
    q, k, v = torch.tensor([0., 1, 2, 3]), torch.tensor([10., 11]), torch.tensor([20., 21])
    assert fused_qkv(q, k, v, groups=2).tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    weights = fused_qkv(q[:, None].expand(4, 3), k[:, None].expand(2, 3), v[:, None].expand(2, 3), groups=2)
    assert weights[:, 0].tolist() == [0, 1, 10, 20, 2, 3, 11, 21] and weights.shape == (8, 3)


def test_weights_names_and_tensors() -> None:
    model = tiny_model("qwen2")
    weights = HFWeights(model.config.to_dict(), model.state_dict())
    assert len(weights) == 3 + 7 * 2 and "output_layer.weight" in weights
    qkv = weights["decoder.layers.1.self_attention.linear_qkv.bias"]
    attn = model.model.layers[1].self_attn
    assert torch.equal(qkv[:32], attn.q_proj.bias[:32])  # group 0: query heads 0, 1 (16 rows each)
    assert torch.equal(qkv[32:48], attn.k_proj.bias[:16]) and torch.equal(qkv[48:64], attn.v_proj.bias[:16])
    fc1 = weights["decoder.layers.0.mlp.linear_fc1.weight"]
    mlp = model.model.layers[0].mlp
    assert torch.equal(fc1, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
    tied = tiny_model("llama", tie_word_embeddings=True)
    assert "output_layer.weight" not in HFWeights(tied.config.to_dict(), tied.state_dict())


def test_missing_misshapen_and_unused_tensors_are_refused() -> None:
    model = tiny_model("llama")
    cfg, tensors = model.config.to_dict(), dict(model.state_dict())
    missing = {k: t for k, t in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match=r"checkpoint tensor 'model.layers.1.mlp.up_proj.weight' is missing: "
                                         r"Megatron's decoder.layers.1.mlp.linear_fc1.weight is made of"):
        HFWeights(cfg, missing)
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(32,\); the config \(llama\) gives \(64,\)"):
        HFWeights(cfg, {**tensors, "model.norm.weight": torch.ones(32)})
    with pytest.raises(ValueError, match=r"tensors \['model.layers.0.self_attn.q_norm.weight'\] have no place"):
        HFWeights(cfg, {**tensors, "model.layers.0.self_attn.q_norm.weight": torch.ones(16)})


def test_a_model_file_names_model_or_checkpoint() -> None:
    setup = {"name": "x", "dtype": "fp32", "attention": "ring", "parallel": {"cp": 2}}
    file = parse_model_file({**setup, "checkpoint": "/ckpt", "gguf_file": "m.gguf"})
    assert isinstance(file, GPTCheckpointConfig) and file.gguf_file == "m.gguf"
    cfg = file.with_model(model_fields(config()))
    assert cfg.parallel.cp == 2 and cfg.model.activation == "swiglu" and cfg.name == "x"
    with pytest.raises(ConfigError, match="checkpoint = '/ckpt': this entry point builds a GPT of the sizes"):
        GPTConfig.parse({**setup, "checkpoint": "/ckpt"})  # training, the equivalence check
    with pytest.raises(ConfigError, match="model and checkpoint are both given"):
        parse_model_file({**setup, "checkpoint": "/ckpt", "model": {}})
    with pytest.raises(ConfigError, match=r"unknown key 'guf_file' \(did you mean 'gguf_file'\?\)"):
        parse_model_file({**setup, "checkpoint": "/ckpt", "guf_file": "m.gguf"})
    with pytest.raises(ConfigError, match=r"attention = 'sdpa' \(the fused block kernel alone\) needs parallel.cp = 1"):
        GPTCheckpointConfig.parse({**setup, "attention": "sdpa", "checkpoint": "/c"}).with_model(model_fields(config()))
