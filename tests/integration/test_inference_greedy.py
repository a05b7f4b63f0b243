"""Greedy generation does not depend on the layout: same weights, same prompt, same tokens (fp32).

Ring prefill (zigzag over cp) + decode from the CP-sharded KV cache must reproduce the cp = 1
tokens exactly, and so must the Megatron TP x PP baseline.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from megatron_ring.config import load_mapping
from tests.integration.inference_workers import greedy_tokens

pytestmark = [pytest.mark.integration, pytest.mark.pool_family("frameworks")]

ROOT = Path(__file__).resolve().parents[2]
TOY = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
       "ffn_hidden_size": 128, "vocab_size": 128}
WORK = {"batch": 2, "prompt_len": 48, "new_tokens": 10, "seed": 5}


def test_toy_greedy_tokens_match_for_cp_1_2_4(gloo_pool) -> None:
    """The reference runner: cp=1 (4 dp replicas), cp=2 x dp=2, cp=4 on one pool of 4 ranks."""
    outs = {}
    for name, layout in {"cp1": {"dp": 4}, "cp2": {"cp": 2, "dp": 2}, "cp4": {"cp": 4}}.items():
        per_rank = gloo_pool(4).run(greedy_tokens, "toy", TOY, layout, WORK)
        assert all(r == per_rank[0] for r in per_rank), f"{name}: ranks disagree"
        outs[name] = per_rank[0]
    assert len(outs["cp1"]) == WORK["batch"] and len(set(outs["cp1"][0])) > 1, "degenerate generation"
    assert outs["cp2"] == outs["cp1"] and outs["cp4"] == outs["cp1"], outs


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")
def test_megatron_greedy_tokens_match_cp1_ring_cp2_cp4_and_tp2_pp2(gloo_pool) -> None:
    """Megatron GPT from the same seed: local attention cp=1, ring cp=2 and cp=4, TP2 x PP2 baseline."""
    cases = {"cp1": ("tiny_local.yaml", {}), "cp2": ("tiny_ring_cp2.yaml", {"cp": 2}),
             "cp4": ("tiny_ring_cp4.yaml", {"cp": 4}), "tp2pp2": ("tiny_sdpa_tp2_pp2.yaml", {"tp": 2, "pp": 2})}
    outs = {}
    for name, (yaml_name, layout) in cases.items():
        model = load_mapping(ROOT / "configs" / "megatron" / yaml_name)
        world = 1
        for size in layout.values():
            world *= size
        per_rank = gloo_pool(world).run(greedy_tokens, "megatron", model, layout, WORK, timeout_s=300)
        assert all(r == per_rank[0] for r in per_rank), f"{name}: ranks disagree"
        outs[name] = per_rank[0]
    assert len(set(outs["cp1"][0])) > 1, "degenerate generation"
    for name in ("cp2", "cp4", "tp2pp2"):
        assert outs[name] == outs["cp1"], f"{name} differs from cp1:\n{outs[name]}\nvs\n{outs['cp1']}"
