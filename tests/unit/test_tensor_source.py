"""HFWeights read a slice at a time (Note [TP slices of fused tensors] in integrations/megatron/hf_weights.py): every
TP slice built from slices of a safetensors checkpoint equals the chunk of the whole fused tensor; reads are copies
of only what was asked for."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from megatron_ring.integrations.megatron.hf_weights import HFWeights  # noqa: E402
from megatron_ring.integrations.megatron.tensor_source import SafetensorsTensors, TensorDict  # noqa: E402
from megatron_ring.testing.tiny_hf import tiny_model  # noqa: E402


@pytest.mark.parametrize("family, overrides", [("llama", {}), ("qwen2", {"tie_word_embeddings": True})],
                         ids=["llama", "qwen2-tied"])
def test_tp_slices_from_files_equal_chunks_of_the_whole(tmp_path: Path, family: str, overrides: dict) -> None:
    model = tiny_model(family, **overrides)
    model.save_pretrained(tmp_path)
    files = SafetensorsTensors.of(tmp_path)
    assert files is not None
    whole = HFWeights(model.config.to_dict(), model.state_dict())
    sliced = HFWeights(model.config.to_dict(), files)
    assert files.reads == []  # checking names and shapes reads nothing
    for key in whole:
        assert torch.equal(sliced[key], whole[key]), key
        gated = ".mlp.linear_fc1." in key
        for dim in range(whole[key].dim()):
            for parts in (1, 2):
                for index in range(parts):
                    full = whole[key]
                    expected = (torch.cat([h.chunk(parts, dim)[index] for h in full.chunk(2, dim)], dim)
                                if gated and dim == 0 else full.chunk(parts, dim)[index])
                    got = sliced.tp_slice(key, dim=dim, parts=parts, index=index, gated=gated)
                    assert torch.equal(got, expected), (key, dim, parts, index)
                    assert torch.equal(whole.tp_slice(key, dim=dim, parts=parts, index=index, gated=gated), expected)
                    into = torch.empty_like(expected)
                    sliced.tp_slice(key, dim=dim, parts=parts, index=index, gated=gated, out=into)
                    assert torch.equal(into, expected), (key, dim, parts, index, "out")
    with pytest.raises(ValueError, match=r"has shape \(64,\), its destination \(3,\)"):
        sliced.tp_slice("decoder.final_layernorm.weight", dim=0, parts=1, index=0, gated=False, out=torch.empty(3))


def test_a_read_copies_only_its_slice(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    tensor = torch.arange(24, dtype=torch.bfloat16).reshape(4, 6)
    save_file({"w": tensor}, str(tmp_path / "model.safetensors"))
    files = SafetensorsTensors.of(tmp_path)
    cols = files.read("w", 1, 2, 4)
    assert cols.dtype == torch.float32 and cols.is_contiguous() and cols.untyped_storage().nbytes() == 4 * 2 * 4
    assert torch.equal(cols, tensor[:, 2:4].float())
    assert torch.equal(files.read("w"), tensor.float())
    assert files.reads == [("w", 1, 2, 4), ("w", 0, 0, None)]
    assert torch.equal(TensorDict({"w": tensor}).read("w", 0, 1, 3), tensor[1:3].float())
    assert SafetensorsTensors.of(tmp_path / "nothing-here") is None


def test_reads_in_blocks_give_the_same_slices(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Note [One tensor's pages at a time]: a slice copied through many small mappings is the same slice."""
    from safetensors.torch import save_file

    from megatron_ring.integrations.megatron import tensor_source

    tensor = torch.randn(37, 10, generator=torch.Generator().manual_seed(0))
    save_file({"w": tensor, "b": tensor[:, 0].contiguous()}, str(tmp_path / "model.safetensors"))
    monkeypatch.setattr(tensor_source, "BLOCK_BYTES", 3 * 10 * 4)  # three rows per mapping
    files = SafetensorsTensors.of(tmp_path)
    assert torch.equal(files.read("w"), tensor)
    assert torch.equal(files.read("w", 0, 5, 30), tensor[5:30])
    assert torch.equal(files.read("w", 1, 3, 7), tensor[:, 3:7])
    assert torch.equal(files.read("b", 0, 1, 36), tensor[1:36, 0])
