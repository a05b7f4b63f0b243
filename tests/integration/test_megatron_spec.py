"""Spec functions: the ring spec differs from Megatron's local spec only in core_attention."""
from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("megatron.core")

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.spec_utils import ModuleSpec, import_module  # noqa: E402
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules  # noqa: E402

from megatron_ring.megatron import RingAttention, get_gpt_layer_ring_spec, use_ring_attention  # noqa: E402


def _leaves(node: object, path: str = "") -> dict[str, object]:
    """Every leaf of a spec tree by dotted path."""
    if isinstance(node, ModuleSpec):
        return {f"{path}.module": node.module, **_leaves(node.submodules, path)}
    if isinstance(node, list):
        return {k: v for i, item in enumerate(node) for k, v in _leaves(item, f"{path}[{i}]").items()}
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return {k: v for f in dataclasses.fields(node) for k, v in _leaves(getattr(node, f.name), f"{path}.{f.name}").items()}
    return {path: node}


@pytest.mark.parametrize("kwargs", [{}, {"qk_layernorm": True, "normalization": "RMSNorm"}])
def test_ring_spec_swaps_only_core_attention(kwargs: dict) -> None:
    local, ring = _leaves(get_gpt_layer_local_spec(**kwargs)), _leaves(get_gpt_layer_ring_spec(**kwargs))
    assert local.keys() == ring.keys()
    diff = {k for k in local if local[k] != ring[k]}
    assert diff == {".self_attention.core_attention"}
    assert local[".self_attention.core_attention"] is DotProductAttention
    assert ring[".self_attention.core_attention"] is RingAttention


def test_use_ring_attention_on_block_spec_leaves_input_untouched() -> None:
    block = TransformerBlockSubmodules(layer_specs=[get_gpt_layer_local_spec() for _ in range(3)])
    swapped = use_ring_attention(block)
    assert [s.submodules.self_attention.submodules.core_attention for s in swapped.layer_specs] == [RingAttention] * 3
    assert all(s.submodules.self_attention.submodules.core_attention is DotProductAttention for s in block.layer_specs)


def test_megatron_lm_spec_flag_imports_a_module_spec() -> None:
    spec = import_module(("megatron_ring.megatron", "gpt_layer_ring_spec"))
    assert isinstance(spec, ModuleSpec)
    assert spec.submodules.self_attention.submodules.core_attention is RingAttention


def test_refuses_specs_it_cannot_serve() -> None:
    with pytest.raises(ValueError, match="multi_latent_attention"):
        get_gpt_layer_ring_spec(multi_latent_attention=True)
    with pytest.raises(ValueError, match="multi-latent attention"):
        use_ring_attention(get_gpt_layer_local_spec(multi_latent_attention=True))
    with pytest.raises(ValueError, match="no core_attention found"):
        use_ring_attention(ModuleSpec(module=DotProductAttention))


def test_transformer_engine_spec() -> None:
    pytest.importorskip("transformer_engine")
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    spec = use_ring_attention(get_gpt_layer_with_transformer_engine_spec())
    assert spec.submodules.self_attention.submodules.core_attention is RingAttention


def test_ring_attention_without_torch_distributed_is_plain_attention() -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    if dist.is_initialized() or parallel_state.model_parallel_is_initialized():
        pytest.skip("needs a process without torch.distributed / parallel_state")
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                               attention_dropout=0.0, use_cpu_initialization=True)
    ring = RingAttention(config, 1, AttnMaskType.causal, "self")
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(12, 2, 4, 8, generator=gen), torch.randn(12, 2, 2, 8, generator=gen), torch.randn(12, 2, 2, 8, generator=gen)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.permute(1, 2, 0, 3), k.repeat_interleave(2, 2).permute(1, 2, 0, 3), v.repeat_interleave(2, 2).permute(1, 2, 0, 3),
        is_causal=True)
    out = ring(q, k, v, None)
    assert out.shape == (12, 2, 32)
    torch.testing.assert_close(out, ref.permute(2, 0, 1, 3).reshape(12, 2, 32), rtol=1e-5, atol=1e-6)
