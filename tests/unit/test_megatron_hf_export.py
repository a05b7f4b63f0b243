"""The inverse of the converter (export of a Megatron-engine model to transformers): tensors and config.

``hf_tensors(HFWeights(...))`` gives back the transformers state dict exactly, for every family;
``transformers_fields`` writes a config that converts back to the same model fields, with the
pretrained config's other keys kept, or from a model of random weights alone; what transformers'
Llama / Qwen2 / Mistral cannot hold is refused naming the field.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from megatron_ring.integrations.megatron.hf_config import model_fields, transformers_fields  # noqa: E402
from megatron_ring.integrations.megatron.hf_weights import HFWeights, hf_tensors, split_qkv, fused_qkv  # noqa: E402
from megatron_ring.testing.tiny_hf import tiny_config, tiny_model  # noqa: E402

FAMILIES = {"llama": {}, "qwen2-tied": {"tie_word_embeddings": True}, "mistral-window": {"sliding_window": 8}}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_tensors_and_config_round_trip(name: str) -> None:
    family = name.split("-")[0]
    model = tiny_model(family, **FAMILIES[name])
    config = model.config.to_dict()
    weights = HFWeights(config, model.state_dict())
    back = hf_tensors(weights.fields, {key: weights[key] for key in weights})
    state = model.state_dict()
    assert set(back) == set(state) - ({"lm_head.weight"} if weights.fields["tie_embeddings"] else set())
    assert all(torch.equal(back[key], state[key]) for key in back)
    written = transformers_fields(weights.fields, config)
    assert model_fields(written) == weights.fields
    assert written["eos_token_id"] == config["eos_token_id"]  # the pretrained config's other keys stay
    alone = transformers_fields(weights.fields)  # a model of random weights: no pretrained config
    assert alone["model_type"] == family and model_fields(alone) == weights.fields


def test_split_qkv_inverts_fused_qkv() -> None:
    q, k, v = torch.randn(8, 3), torch.randn(4, 3), torch.randn(4, 3)
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused_qkv(q, k, v, groups=2), groups=2, q_rows=8), (q, k, v)))


def test_overridden_rope_is_written() -> None:
    fields = {**model_fields(tiny_config().to_dict()), "rope_scaling": {"type": "linear", "factor": 2.0}}
    written = transformers_fields(fields, tiny_config().to_dict())
    assert written["rope_parameters"] == {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    assert model_fields(written)["rope_scaling"] == {"type": "linear", "factor": 2.0}


@pytest.mark.parametrize("field,value", [("normalization", "LayerNorm"), ("activation", "gelu"),
                                         ("add_bias_linear", True), ("position_embedding", "learned_absolute")])
def test_what_transformers_cannot_hold_is_refused(field: str, value: object) -> None:
    fields = {**model_fields(tiny_config().to_dict()), field: value}
    with pytest.raises(ValueError, match=f"model.{field} = {value!r} has no place"):
        transformers_fields(fields)
