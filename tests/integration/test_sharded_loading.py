"""Sharded loading (Note [Sharded loading] in integrations/megatron/hf_checkpoint.py): at tp 2 x pp 2 each rank reads
from the safetensors files only its stage's tensors and only its TP half of each, exactly as many elements as its
parameters hold, and the model it builds equals the one loaded from transformers' whole model, bit for bit.
"""
from __future__ import annotations

import re
from typing import Any

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")

from megatron_ring.testing.tiny_hf import save_tiny_model  # noqa: E402
from tests.integration import sharded_loading_workers as workers  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.pool_family("frameworks")]
ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")  # split along their columns (dim 1)


def _stage_names(name: str, pp_rank: int, tied: bool) -> bool:
    """Whether checkpoint tensor ``name`` belongs to pipeline stage ``pp_rank`` of the tiny 2-layer model at pp 2."""
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    if layer:
        return int(layer.group(1)) == pp_rank
    if name == "model.embed_tokens.weight":
        return pp_rank == 0 or tied  # the last stage's output layer reads the tied embedding
    return pp_rank == 1  # model.norm, lm_head


@pytest.mark.parametrize("family, overrides", [("llama", {}), ("qwen2", {"tie_word_embeddings": True})],
                         ids=["llama", "qwen2-tied"])
def test_each_rank_reads_its_slices_only(gloo_pool: Any, tmp_path: Any, family: str, overrides: dict) -> None:
    directory = save_tiny_model(family, tmp_path / family, **overrides)
    tied = overrides.get("tie_word_embeddings", False)
    per_rank = gloo_pool(4).run(workers.sharded_and_whole, directory, {"tp": 2, "pp": 2}, timeout_s=300)
    for rank, out in enumerate(per_rank):
        label = f"{family} rank {rank} (tp {out['tp_rank']}, pp {out['pp_rank']})"
        assert out["equal"], f"{label}: the model read in slices differs from the whole load"
        read = 0
        for name, dim, start, stop in out["reads"]:
            assert _stage_names(name, out["pp_rank"], tied), f"{label} read {name}, another stage's"
            shape = out["shapes"][name]
            if "norm" in name:
                assert (dim, start, stop) == (0, 0, shape[0]), f"{label}: {name} read as {(dim, start, stop)}"
                read += shape[0]
                continue
            expected_dim = 1 if name.endswith(ROW_PARALLEL) else 0
            half = shape[expected_dim] // 2
            assert (dim, start, stop) == (expected_dim, out["tp_rank"] * half, (out["tp_rank"] + 1) * half), \
                f"{label}: {name} {shape} read as {(dim, start, stop)}, not its TP half"
            read += half * (shape[0] * shape[1] // shape[expected_dim] if len(shape) == 2 else 1)
        assert read == out["elements"], f"{label}: read {read} elements for {out['elements']} parameters"
        names = [r[0] for r in out["reads"]]
        assert len(names) == len(set(names)), f"{label}: a tensor read twice: {names}"


UNEVEN = {"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3}
"""3 K/V heads: AutoTP splits them 2 and 1 over 2 ranks, as SmolLM2's."""


@pytest.mark.parametrize("family, overrides", [("llama", UNEVEN), ("qwen2", {"tie_word_embeddings": True})],
                         ids=["llama-6-over-3-heads", "qwen2-tied"])
def test_autotp_ranks_read_their_slices_only(gloo_pool: Any, tmp_path: Any, family: str, overrides: dict) -> None:
    """The hf runner at tp 2 (Note [AutoTP from slices]): the model equals transformers' whole model cut by AutoTP,
    parameters and buffers; each rank reads as many elements as it holds, a row-parallel weight by columns. 3 K/V
    heads split unevenly over 2 ranks (2 and 1, as SmolLM2's at tp 2)."""
    directory = save_tiny_model(family, tmp_path / family, **overrides)
    per_rank = gloo_pool(2).run(workers.autotp_sharded_and_whole, directory, 2, timeout_s=300)
    for rank, out in enumerate(per_rank):
        assert out["equal"], f"{family} rank {rank}: the model read in slices differs from AutoTP's cut of the whole"
        read = 0
        for name, dim, start, stop in out["reads"]:
            shape = out["shapes"][name]
            if name.endswith(ROW_PARALLEL):
                assert dim == 1 and 0 < stop - start < shape[1], f"rank {rank}: {name} read as {(dim, start, stop)}"
            extent = (stop if stop is not None else shape[dim]) - start
            read += extent * (shape[0] * shape[1] // shape[dim] if len(shape) == 2 else 1)
        assert read == out["elements"], f"{family} rank {rank}: read {read} elements for {out['elements']}"
        if overrides is UNEVEN:  # K/V heads 2 and 1, 16 rows each
            k_proj = [r[2:] for r in out["reads"] if r[0] == "model.layers.0.self_attn.k_proj.weight"]
            assert k_proj == [[(0, 32)], [(32, 48)]][rank], f"rank {rank}: k_proj rows {k_proj}"
