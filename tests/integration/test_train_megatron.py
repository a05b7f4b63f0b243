"""``engine: megatron`` on gloo: Megatron-core's DDP, distributed optimizer and pipeline schedules
train every layout like cp = 1, and a checkpoint resumes at another layout.

Four CPU ranks train the same tiny GPT (every layout starts from the same weights, Note [Initial
weights of any layout]) on the same global batch of real text with the distributed optimizer on:
cp = 1 (Megatron's own attention, dp = 4) is the reference, run once per module; ring attention at
cp2·dp2, tp2·cp2 (without and with sequence parallelism) and pp2·cp2 (1F1B), and at pp2·cp2 with two
virtual stages (interleaved 1F1B) over 4 and 8 micro-batches, pp4 with two virtual stages, and with
full or selective recomputation, must give the same per-step losses (1e-6 relative) and final weights
(1e-5), and so must the held-out loss of an ``eval`` section (forward-only schedules) at steps 0, 2
and 4. Four steps suffice: with the gradient 2x off at tp2·cp2 and pp2·cp2 (``calculate_per_token_loss``
set after DDP wrapping) their step-3 loss was 4.5e-6 off, interleaved pp2·cp2's step-4 loss 3.5e-4
(the interleaved cases take 3: megatron-core's batched p2p was 3e-3 off at step 1). The
resume tests save after 2 steps at one layout and take 2 more (Adam's bias correction still far
from 1) at another; the 4 losses and the final weights must equal the cp = 1 run that never
stopped (one step tensor shared after the load: step-4 loss 2e-3 off). The shipped YAML with
Megatron-LM's names trains like the shipped JSON, and bad YAMLs are refused naming their keys. Workers:
tests/integration/train_workers.py; the 4-rank pool is shared (tests/conftest.py).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

pytest.importorskip("megatron.core")

from megatron_ring.config import ConfigError, load_mapping  # noqa: E402
from megatron_ring.training.schema import parse_train_spec  # noqa: E402
from tests.integration import train_workers  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.pool_family("frameworks"), pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "configs" / "megatron"
LOSS_TOL = 1e-6
WEIGHT_TOL = 1e-5
STEPS = 4
HELD_OUT = ROOT / "data" / "corpus" / "BSD.txt"
"""The ``eval`` section's file (23 rows of 65 bytes): its held-out loss at steps 0, 2 and 4 equals cp 1's too."""
CONSTANT = {"scheduler": {"warmup_steps": 3, "decay_style": "constant"}}
"""The resume tests' schedule (see there)."""


def config(layout: dict[str, int], steps: int = STEPS, *, model: str = "tiny_ring_tp2_cp2.yaml",
           megatron: dict[str, Any] | None = None, **section: Any) -> dict[str, Any]:
    """A Megatron-engine config for ``layout`` on 4 ranks: global batch 4, fp32 Adam with clipping,
    a warm-up then cosine schedule, the distributed optimizer with overlapped gradient reduction.

    The schedule's first step has lr 0 (Megatron's warm-up starts at 0), the second the full lr,
    and the cosine decay runs from the third to the last."""
    dp = layout.get("dp", 1)
    ring = {"engine": "megatron", "model": str(MODELS / model), "attention": "ring" if layout.get("cp", 1) > 1 else "local",
            "layout": layout, "seq_len": 64, "steps": steps,
            "data": {"kind": "text", "paths": [str(ROOT / "data" / "corpus")], "seed": 7}, "log": {"progress": False},
            "eval": {"paths": [str(HELD_OUT)], "interval": 2},
            # adam_eps 1e-4: see the same choice in test_train_equivalence.py
            "megatron": {"optimizer": {"lr": 1e-3, "adam_eps": 1e-4, "weight_decay": 0.01, "clip_grad": 1.0},
                         "scheduler": {"warmup_steps": 1, "decay_style": "cosine"}, **(megatron or {})}}
    ring.update(section)
    return {"train_batch_size": 4, "gradient_accumulation_steps": 4 // dp, "megatron_ring": ring}


def run(pool: Any, raw: dict[str, Any]) -> dict[str, Any]:
    return train_workers.run_on_pool(pool, raw, str(ROOT))


def assert_same(got: dict[str, Any], ref: dict[str, Any], what: str) -> None:
    train_workers.assert_same_training(got, ref, what, loss_tol=LOSS_TOL, weight_tol=WEIGHT_TOL)


@pytest.fixture(scope="module")
def reference(gloo_pool: Any) -> dict[str, Any]:
    """cp = 1, dp = 4, Megatron's own attention: :data:`STEPS` steps, warm-up then cosine."""
    ref = run(gloo_pool(4), config({"cp": 1, "dp": 4}))
    assert len(ref["losses"]) == STEPS and ref["losses"][-1] < ref["losses"][0]
    assert sorted(ref["evals"]) == [0, 2, 4] and ref["evals"][4] < ref["evals"][0], ref["evals"]
    return ref


@pytest.fixture(scope="module")
def constant_reference(gloo_pool: Any) -> dict[str, Any]:
    """cp = 1, dp = 4 with the resume tests' schedule (:data:`CONSTANT`), 4 steps, never stopped."""
    ref = run(gloo_pool(4), config({"cp": 1, "dp": 4}, 4, megatron=CONSTANT))
    assert len(ref["losses"]) == 4 and ref["losses"][-1] < ref["losses"][0]
    return ref


@pytest.mark.parametrize("layout,megatron", [({"cp": 2, "dp": 2}, {}), ({"tp": 2, "cp": 2}, {}),
                                             ({"tp": 2, "cp": 2}, {"sequence_parallel": True}),
                                             ({"pp": 2, "cp": 2}, {})],
                         ids=["cp2-dp2", "tp2-cp2", "tp2-cp2-sp", "pp2-cp2"])
def test_layouts_train_like_cp1(gloo_pool: Any, reference: dict[str, Any], layout: dict[str, int],
                                megatron: dict[str, Any]) -> None:
    """Every layout, and tp2·cp2 with sequence parallelism (Note [Sequence parallelism and the ring]), equals cp 1."""
    assert_same(run(gloo_pool(4), config(layout, megatron=megatron)), reference, f"{layout} {megatron}")


def test_interleaved_pipeline_and_recompute_train_like_cp1(gloo_pool: Any) -> None:
    """4 layers, a global batch of 8, 3 steps: pp2·cp2 with 2 virtual stages over 4 and 8 micro-batches (more
    than the stages: Note [Interleaved p2p at pp = 2]; with megatron-core's batched p2p step 1 gave 4.904 / 4.905
    instead of 4.891), and cp2·dp2 recomputing every layer or only the core attention (selective), against cp 1."""
    pool, model = gloo_pool(4), "tiny_ring_4layers.yaml"

    def eight(layout: dict[str, int], micro_batches: int, held_out: bool = False, **megatron: Any) -> dict[str, Any]:
        raw = config(layout, 3, model=model, megatron=megatron)
        raw.update(train_batch_size=8, gradient_accumulation_steps=micro_batches)
        if not held_out:  # the forward-only interleaved schedule is checked once (4 micro-batches)
            del raw["megatron_ring"]["eval"]
        return raw

    ref = run(pool, eight({"cp": 1, "dp": 4}, 2, held_out=True))
    for micro_batches in (4, 8):
        assert_same(run(pool, eight({"pp": 2, "cp": 2}, micro_batches, micro_batches == 4, virtual_pipeline=2)), ref,
                    f"pp2-cp2 vp2, {micro_batches} micro-batches")
    full = {"granularity": "full", "method": "uniform", "num_layers": 1}
    for recompute in (full, {"granularity": "selective"}):
        assert_same(run(pool, eight({"cp": 2, "dp": 2}, 2, recompute=recompute)), ref,
                    f"cp2-dp2 {recompute['granularity']} recompute")


def test_interleaved_pp4_trains_like_cp1(gloo_pool: Any, tmp_path: Path) -> None:
    """8 layers, pp 4 with 2 virtual stages over 4 micro-batches (prev and next are distinct peers: Note
    [Interleaved p2p at pp = 2]), 3 steps, against cp 1 (Megatron's attention at both)."""
    model = load_mapping(MODELS / "tiny_ring_4layers.yaml")
    model["model"]["num_layers"] = 8
    path = tmp_path / "tiny_8layers.yaml"
    path.write_text(yaml.safe_dump(model))

    def eight(layout: dict[str, int], micro_batches: int, **megatron: Any) -> dict[str, Any]:
        raw = config(layout, 3, model=str(path), megatron=megatron)
        raw.update(train_batch_size=8, gradient_accumulation_steps=micro_batches)
        del raw["megatron_ring"]["eval"]
        return raw

    pool = gloo_pool(4)
    assert_same(run(pool, eight({"pp": 4}, 4, virtual_pipeline=2)), run(pool, eight({"cp": 1, "dp": 4}, 2)),
                "pp4 vp2, 4 micro-batches")


@pytest.mark.parametrize("first,then", [({"cp": 2, "dp": 2}, {"tp": 2, "cp": 2}),
                                        ({"tp": 2, "cp": 2}, {"pp": 2, "cp": 2}),
                                        ({"pp": 2, "cp": 2}, {"cp": 1, "dp": 4})],
                         ids=["cp2dp2-to-tp2cp2", "tp2cp2-to-pp2cp2", "pp2cp2-to-cp1"])
def test_resume_at_another_layout(gloo_pool: Any, constant_reference: dict[str, Any], tmp_path: Path,
                                  first: dict[str, int], then: dict[str, int]) -> None:
    """2 steps at ``first``, saved; resumed at ``then`` up to 4: the 4 losses and the final weights
    of the cp = 1 run that never stopped (which every layout equals, test_layouts_train_like_cp1).

    Steps 3 and 4 run on the loaded Adam states, whose bias correction (1 - 0.9^3 = 0.27 at step 3)
    a wrong or shared ``step`` would change (Note [The step of torch's Adam on load])."""
    pool = gloo_pool(4)
    # a decay horizon is the config's steps, and resume keeps the checkpoint's (Megatron's
    # use_checkpoint_opt_param_scheduler): the 2-step first part decays over 2 steps; hence warm-up only
    ckpt = {"dir": str(tmp_path / "ckpt"), "save_interval": 0}
    before = run(pool, config(first, 2, megatron=CONSTANT, checkpoint=ckpt))
    after = run(pool, config(then, 4, megatron=CONSTANT, checkpoint=ckpt))
    assert before["start_step"] == 0 and after["start_step"] == 2
    assert_same({"losses": before["losses"] + after["losses"], "weights": after["weights"]}, constant_reference,
                f"{first} -> {then}")


def good() -> dict[str, Any]:
    return config({"pp": 2, "cp": 2})


BAD = {
    "DeepSpeed key": ("zero_optimization", {"stage": 1}, ["DeepSpeed key 'zero_optimization' has no effect",
                                                          "engine = 'megatron'", "train_batch_size"]),
    "no section": ("megatron_ring.megatron", None, ["engine = 'megatron' needs a megatron_ring.megatron section"]),
    "unknown key": ("megatron_ring.megatron.optimizer.lrr", 0.1, ["lrr", "did you mean 'lr'"]),
    "optimizer type": ("megatron_ring.megatron.optimizer.type", "lamb", ["megatron_ring.megatron.optimizer.type",
                                                                         "lamb", "'adam'", "'sgd'"]),
    "negative lr": ("megatron_ring.megatron.optimizer.lr", -1.0, ["megatron_ring.megatron.optimizer.lr = -1.0"]),
    "min_lr above lr": ("megatron_ring.megatron.optimizer.min_lr", 1.0,
                        ["megatron_ring.megatron.optimizer.min_lr = 1.0 is above optimizer.lr", "min_lr <= lr"]),
    "recompute full": ("megatron_ring.megatron.recompute", {"granularity": "full"},
                       ["recompute.granularity = 'full' needs recompute.method"]),
    "vp layers": ("megatron_ring.megatron.virtual_pipeline", 2, ["virtual_pipeline = 2", "num_layers = 2",
                                                                 "pp * virtual_pipeline = 4"]),
    "sp without tp": ("megatron_ring.megatron.sequence_parallel", True,
                      ["parallel.sequence_parallel = true needs parallel.tp > 1", "got tp = 1"]),
    "engine name": ("megatron_ring.engine", "megatorn", ["megatron_ring.engine = 'megatorn'", "'deepspeed'",
                                                         "'megatron'"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_megatron_config_names_the_field(case: str) -> None:
    dotted, value, needles = BAD[case]
    with pytest.raises(ConfigError) as err:
        parse_train_spec(train_workers.changed(good(), dotted, value), world_size=4, base_dir=ROOT)
    for needle in needles:
        assert needle in str(err.value), f"{needle!r} not in: {err.value}"


def test_interleaved_micro_batches_not_a_multiple_of_pp_are_refused() -> None:
    raw = config({"pp": 2, "cp": 2}, model="tiny_ring_4layers.yaml", megatron={"virtual_pipeline": 2})
    raw.update(train_batch_size=3, gradient_accumulation_steps=3)
    with pytest.raises(ConfigError) as err:
        parse_train_spec(raw, world_size=4, base_dir=ROOT)
    assert "virtual_pipeline = 2: the interleaved schedule" in str(err.value)
    assert "must be a multiple of 2, got 3" in str(err.value)


def test_sequence_parallel_is_refused_where_it_cannot_run(tmp_path: Path) -> None:
    """A model file with ``parallel.sequence_parallel`` under DeepSpeed's engine (which would not sum the norms'
    gradients over TP), and packed documents with it, are refused naming why."""
    model = load_mapping(MODELS / "tiny_ring_tp2_cp2.yaml")
    model["parallel"]["sequence_parallel"] = True
    path = tmp_path / "sp.yaml"
    path.write_text(yaml.safe_dump(model))
    raw = config({"tp": 2, "cp": 2}, model=str(path))
    raw["megatron_ring"]["engine"] = "deepspeed"
    del raw["megatron_ring"]["megatron"]
    with pytest.raises(ConfigError) as err:
        parse_train_spec(raw, world_size=4, base_dir=ROOT)
    assert "sequence_parallel" in str(err.value) and "engine = 'megatron' only" in str(err.value)
    raw = config({"tp": 2, "cp": 2}, model=str(path))
    raw["megatron_ring"]["data"] = {"kind": "chat", "paths": [str(tmp_path)]}
    with pytest.raises(ConfigError) as err:
        parse_train_spec(raw, world_size=4, base_dir=ROOT)
    assert "which sequence_parallel would have to split over the TP ranks" in str(err.value)


def test_deepspeed_engine_refuses_pipeline_and_megatron_section() -> None:
    raw = good()
    raw["megatron_ring"]["engine"] = "deepspeed"
    with pytest.raises(ConfigError) as err:
        parse_train_spec(raw, world_size=4, base_dir=ROOT)
    assert "layout.pp = 2: engine 'deepspeed' trains one pipeline stage" in str(err.value)
    assert "megatron_ring.megatron configures engine 'megatron' only" in str(err.value)


@pytest.mark.probe
def test_a_checkpoint_of_another_model_or_engine_is_refused_naming_the_folder(gloo_pool: Any, tmp_path: Path) -> None:
    """A Megatron-engine checkpoint resumed with a model of another size (Megatron's CheckpointingException) or
    by DeepSpeed's engine: one refusal on every rank naming the folder, not a library traceback."""
    from tests.integration.test_train_equivalence import config as deepspeed_config

    pool, ckpt = gloo_pool(4), {"dir": str(tmp_path / "ckpt")}

    def outcome(raw: dict[str, Any]) -> str:
        found = {r.get("error", "") for r in pool.run(train_workers.run_or_refuse, raw, str(ROOT), timeout_s=300)}
        assert len(found) == 1, f"ranks disagree: {found}"
        return found.pop()

    assert outcome(config({"cp": 2, "dp": 2}, 1, checkpoint=ckpt)) == ""
    bigger = outcome(config({"cp": 2, "dp": 2}, 2, model="tiny_ring_4layers.yaml", checkpoint=ckpt))
    assert bigger.startswith("CheckpointError") and str(tmp_path / "ckpt" / "step00000001") in bigger, bigger
    other = outcome(deepspeed_config("cp2-dp2", 0, checkpoint=ckpt))
    assert other.startswith("ConfigError") and "saved by engine 'megatron'" in other and \
        "megatron_ring.engine = 'deepspeed'" in other, other


# --- the YAML with Megatron-LM's names (megatron_ring/training/megatron_args.py) ---------------------------

SHIPPED_YAML = ROOT / "configs" / "train" / "megatron_pp2_cp2.yaml"
SHIPPED_JSON = ROOT / "configs" / "deepspeed" / "train_megatron_pp2_cp2.json"


def shipped_yaml(**changes: Any) -> dict[str, Any]:
    """The shipped YAML without checkpoints or log file, with ``changes`` (None: the key removed)."""
    raw = {key: value for key, value in load_mapping(SHIPPED_YAML).items() if key not in ("save", "load", "log_jsonl")}
    raw.update(log_progress=False, **changes)
    return {key: value for key, value in raw.items() if value is not None}


def test_shipped_yaml_trains_like_the_json(gloo_pool: Any) -> None:
    """configs/train/megatron_pp2_cp2.yaml (Megatron-LM's names: pp2 x 2 virtual stages x cp2, 2 micro-batches
    of 4) against configs/deepspeed/train_megatron_pp2_cp2.json, 2 steps of 64 tokens: the same losses and weights."""
    pool = gloo_pool(4)
    raw_json = load_mapping(SHIPPED_JSON)
    raw_json["megatron_ring"].update(steps=2, seq_len=64, checkpoint={}, log={"progress": False})
    from_json = train_workers.run_on_pool(pool, raw_json, str(SHIPPED_JSON.parent))
    from_yaml = train_workers.run_on_pool(pool, shipped_yaml(train_iters=2, seq_length=64), str(SHIPPED_YAML.parent))
    train_workers.assert_same_training(from_yaml, from_json, "yaml vs json", loss_tol=1e-12, weight_tol=1e-12)


BAD_YAML = {
    "unknown key": ({"tensor_model_paralel_size": 2}, 4, ["'tensor_model_paralel_size'",
                                                         "did you mean 'tensor_model_parallel_size'"]),
    "tp heads": ({"tensor_model_parallel_size": 3, "pipeline_model_parallel_size": 1, "context_parallel_size": 1,
                  "num_layers_per_virtual_pipeline_stage": None}, 3,
                 ["tensor_model_parallel_size = 3 does not divide the model's num_attention_heads = 4"]),
    "sp without tp": ({"sequence_parallel": True}, 4, ["sequence_parallel = true needs tensor_model_parallel_size > 1"]),
    "vp layers": ({"num_layers_per_virtual_pipeline_stage": 3}, 4,
                  ["num_layers_per_virtual_pipeline_stage = 3: the model's num_layers = 4 is not divisible"]),
    "vp micro-batches": ({"global_batch_size": 12}, 4, ["global_batch_size = 12 gives 3 micro-batches per step",
                                                        "must be a multiple of 2"]),
    "world": ({}, 6, ["world size 6 is not divisible by tensor_model_parallel_size * pipeline_model_parallel_size"]),
    "translated field": ({"min_lr": 1.0}, 4, ["min_lr = 1.0 is above lr = 0.003"]),
    "load elsewhere": ({"save": "a", "load": "b"}, 4, ["load = 'b' is not save = 'a'"]),
}


@pytest.mark.parametrize("case", list(BAD_YAML))
def test_bad_megatron_yaml_names_its_key(case: str, tmp_path: Path) -> None:
    """Refused before any rank, by ``load_train_spec`` (what every rank, ``megatron-ring check`` and
    ``megatron-ring train`` run first), naming the YAML's own key."""
    from megatron_ring.training.schema import load_train_spec

    changes, world, needles = BAD_YAML[case]
    path = tmp_path / "train.yaml"
    raw = shipped_yaml(**changes)
    raw.update(model=str(MODELS / "tiny_ring_4layers.yaml"), data_path=[str(ROOT / "data" / "corpus")])
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as err:
        load_train_spec(path, world_size=world)
    for needle in needles:
        assert needle in str(err.value), f"{needle!r} not in: {err.value}"
