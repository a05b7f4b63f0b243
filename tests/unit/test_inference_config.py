"""The inference configs: our section's schema, DeepSpeed's part, and the shipped JSON files."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from megatron_ring.config import ConfigError, load_mapping
from megatron_ring.inference.main import load_spec
from megatron_ring.inference.schema import validate
from megatron_ring.integrations.deepspeed.config import split_config

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs" / "deepspeed"
HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None
TOY = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "ffn_hidden_size": 128, "vocab_size": 128}


def section(**over) -> dict:
    data = {"model": {"runner": "toy", "config": dict(TOY)}, "layout": {"cp": 2},
            "workload": {"batch": 2, "prompt_len": 32, "new_tokens": 4}}
    data.update(over)
    return data


def test_split_keeps_deepspeed_keys_and_takes_ours() -> None:
    raw = {"dtype": "bf16", "megatron_ring": {"x": 1}}
    assert split_config(raw) == ({"dtype": "bf16"}, {"x": 1})
    assert "megatron_ring" in raw
    with pytest.raises(ConfigError, match="no 'megatron_ring' section"):
        split_config({"dtype": "bf16"})


def test_valid_section_and_defaults() -> None:
    spec = validate(section(), {}, world_size=2)
    assert spec.layout.cp == 2 and spec.ring.workload.repeats == 3 and spec.ring.workload.warmup == 1
    assert spec.model_summary["runner"] == "toy" and spec.model_summary["parameters"] > 0


@pytest.mark.parametrize("data, world, needles", [
    (section(layout={"cp": 2, "pipe": 2}), 2, ["unknown key 'layout.pipe'", "did you mean 'pp'"]),
    (section(layout={"cp": 4}), 2, ["layout world size 4", "process world size 2"]),
    (section(workload={"batch": 2, "prompt_len": 30, "new_tokens": 4}), 2, ["prompt_len 30", "2*cp = 4"]),
    (section(workload={"batch": 2, "prompt_len": 32, "new_tokens": 1}), 2, ["workload.new_tokens = 1"]),
    (section(model={"runner": "tpu", "config": TOY}), 2, ["unknown runner", "'megatron'", "'toy'"]),
    (section(model={"runner": "toy", "config": "missing.yaml"}), 2, ["missing.yaml", "file not found"]),
    (section(model={"runner": "toy", "config": {**TOY, "num_query_groups": 3}}), 2, ["num_query_groups = 3"]),
    (section(layout={"tp": 2}), 2, ["tp = pp = 1 only"]),
])
def test_bad_sections_name_field_value_and_allowed(data: dict, world: int, needles: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        validate(data, {}, world_size=world)
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def test_deepspeed_tp_size_must_match_layout() -> None:
    with pytest.raises(ConfigError, match="tensor_parallel.tp_size = 2 disagrees with megatron_ring.layout.tp = 1"):
        validate(section(), {"tensor_parallel": {"tp_size": 2}}, world_size=2)


@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="deepspeed not installed")
def test_deepspeed_keys_are_checked_by_deepspeed(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"dtype": "fp32", "replace_with_kernel_injects": False, "megatron_ring": section()}))
    with pytest.raises(ConfigError, match="did you mean 'replace_with_kernel_inject'"):
        load_spec(path, world_size=2)


@pytest.mark.skipif(not (HAVE_DEEPSPEED and HAVE_MEGATRON), reason="deepspeed or the Megatron runner missing")
@pytest.mark.parametrize("name, world", [("paper_baseline_tp8_pp2", 16), ("paper_ring_cp16", 16),
                                         ("cpu_baseline_tp2_pp2", 4), ("cpu_ring_cp4", 4),
                                         ("cpu_ring_tp2_cp2", 4)])
def test_shipped_configs_validate_for_their_world(name: str, world: int) -> None:
    spec = load_spec(CONFIGS / f"{name}.json", world_size=world)
    assert spec.layout.world_size == world
    with pytest.raises(ConfigError, match=f"process world size {world // 2}"):
        load_spec(CONFIGS / f"{name}.json", world_size=world // 2)


def test_paper_configs_hold_the_papers_setup() -> None:
    """16 layers, d_model 4096 = 32 x 128, FFN 16384, B = 128, a 100k-token sequence, bf16."""
    for name, layout in (("paper_baseline_tp8_pp2", {"tp": 8, "pp": 2, "cp": 1, "dp": 1}),
                         ("paper_ring_cp16", {"tp": 1, "pp": 1, "cp": 16, "dp": 1})):
        ds, ours = split_config(load_mapping(CONFIGS / f"{name}.json"))
        assert ds["dtype"] == "bf16" and ours["layout"] == layout
        work = ours["workload"]
        assert work["batch"] == 128 and work["prompt_len"] + work["new_tokens"] - 1 == 100_000
        model = load_mapping((CONFIGS / ours["model"]["config"]).resolve())["model"]
        assert (model["num_layers"], model["hidden_size"], model["num_attention_heads"], model["head_dim"],
                model["ffn_hidden_size"], model["seq_length"]) == (16, 4096, 32, 128, 16384, 100_000)


def test_cpu_pair_shares_model_sizes_and_workload() -> None:
    loaded = {}
    for name in ("cpu_baseline_tp2_pp2", "cpu_ring_cp4", "cpu_ring_tp2_cp2"):
        ds, ours = split_config(load_mapping(CONFIGS / f"{name}.json"))
        model = load_mapping((CONFIGS / ours["model"]["config"]).resolve())["model"]
        loaded[name] = (ds["dtype"], ours["workload"], model)
    first = loaded["cpu_baseline_tp2_pp2"]
    assert loaded["cpu_ring_cp4"] == first
    assert loaded["cpu_ring_tp2_cp2"][:2] == first[:2]
