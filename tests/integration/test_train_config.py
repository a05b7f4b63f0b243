"""Training configs, data and checkpoint bookkeeping, without processes: bad configs fail before
anything is built (naming the field), the data pipeline shards exactly, resume positions are
deterministic, an interrupted checkpoint is never the latest, and the mpu reports dp x cp."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("pydantic")

from megatron_ring.attention.sharding import unshard_sequence  # noqa: E402
from megatron_ring.config import ConfigError, load_mapping  # noqa: E402
from megatron_ring.parallel.groups import ParallelGroups  # noqa: E402
from megatron_ring.parallel.layout import ParallelLayout  # noqa: E402
from megatron_ring.training.data import ByteTokenizer, PackedSequences, TrainData  # noqa: E402
from megatron_ring.training.checkpoint import COMPLETE, check_resume, latest_checkpoint, optimizer_settings  # noqa: E402
from megatron_ring.training.loop import EXIT_CONFIG, train_main  # noqa: E402
from megatron_ring.integrations.deepspeed.mpu import DeepSpeedMPU  # noqa: E402
from megatron_ring.integrations.deepspeed.zero3 import async_io_available  # noqa: E402
from megatron_ring.training.schema import load_train_spec, parse_train_spec  # noqa: E402
from tests.integration.train_workers import changed  # noqa: E402

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "configs" / "deepspeed").glob("train_*.json"))


def good() -> dict[str, Any]:
    return json.loads((ROOT / "configs" / "deepspeed" / "train_cp2.json").read_text())


def parse(raw: dict[str, Any], world_size: int = 4) -> Any:
    return parse_train_spec(raw, world_size=world_size, base_dir=ROOT / "configs" / "deepspeed")


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_configs_are_valid(path: Path) -> None:
    spec = load_train_spec(path, world_size=4)
    assert spec.global_batch == spec.micro_batch * spec.grad_accum * spec.layout.dp
    if spec.transformers is not None:
        assert spec.model is None and spec.train.transformers.attention == "ring"
    else:
        assert spec.model.model.seq_length == spec.train.seq_len and spec.model.attention == "ring"


BAD = {
    "unknown key (ours)": ("megatron_ring.seq_lenght", 128, ["seq_lenght", "did you mean 'seq_len'"]),
    "unknown nested key": ("megatron_ring.checkpoint.save_intervall", 5, ["save_intervall", "save_interval"]),
    "unknown DeepSpeed key": ("gradient_clip", 1.0, ["gradient_clip", "did you mean 'gradient_clipping'"]),
    "global batch": ("train_batch_size", 6, ["train_batch_size = 6", "2 * 2 * 2 = 8"]),
    "layout vs world": ("megatron_ring.layout", {"tp": 1, "pp": 1, "cp": 2, "dp": 4},
                        ["megatron_ring.layout", "world size 4", "= 8"]),
    "pipeline": ("megatron_ring.layout", {"pp": 2, "cp": 2}, ["layout.pp", "2"]),
    "heads vs tp": ("megatron_ring.layout", {"tp": 3, "cp": 1, "dp": 1}, ["num_attention_heads = 4", "tp = 3"]),
    "missing model": ("megatron_ring.model", "../megatron/nope.yaml", ["nope.yaml", "does not exist"]),
    "missing data": ("megatron_ring.data.paths", ["../../nowhere"], ["data.paths[0]", "nowhere", "does not exist"]),
    "dtype vs model": ("bf16", {"enabled": True}, ["bf16.enabled / fp16.enabled selects bf16",
                                                   "megatron_ring.model = '../megatron/tiny_ring_cp2.yaml' has "
                                                   "dtype = 'fp32'", "allowed: fp32, bf16, fp16"]),
    "attention kind": ("megatron_ring.attention", "flash", ["attention", "flash"]),
    "str for int": ("megatron_ring.seq_len", "128", ["megatron_ring.seq_len = '128'", "valid integer"]),
    "bool for int": ("megatron_ring.steps", True, ["megatron_ring.steps = True", "valid integer"]),
    "float for int": ("megatron_ring.checkpoint.save_interval", 2.5, ["megatron_ring.checkpoint.save_interval = 2.5"]),
    "str in layout": ("megatron_ring.layout", {"tp": 1, "pp": 1, "cp": "2", "dp": 2}, ["megatron_ring.layout.cp = '2'"]),
    "str for bool": ("megatron_ring.data.shuffle", "yes", ["megatron_ring.data.shuffle = 'yes'", "valid boolean"]),
    "optimizer type": ("optimizer.type", "AdamWW", ["optimizer.type = 'AdamWW'", "did you mean 'AdamW'", "adamw"]),
    "optimizer lr": ("optimizer.params.lr", "fast", ["optimizer.params.lr = 'fast'", "AdamW takes a number"]),
    "optimizer betas": ("optimizer.params.betas", [0.9], ["optimizer.params.betas = [0.9]", "a list of 2 numbers"]),
    "optimizer param name": ("optimizer.params.weight_decy", 0.1, ["optimizer.params.weight_decy",
                                                                   "did you mean 'weight_decay'"]),
    "lamb lr": ("optimizer", {"type": "Lamb", "params": {"lr": "fast"}},
                ["optimizer.params.lr = 'fast'", "FusedLamb takes a number"]),
    "lion param name": ("optimizer", {"type": "Lion", "params": {"betaz": [0.9, 0.99]}},
                        ["optimizer.params.betaz: unknown to deepspeed.ops.lion", "did you mean 'betas'"]),
    "muon param name": ("optimizer", {"type": "Muon", "params": {"momentom": 0.9}},
                        ["optimizer.params.momentom: unknown to deepspeed.runtime.zero.muon.muon_optimizer.MuonWithAuxAdam",
                         "did you mean 'momentum'", "muon_lr"]),
    "muon betas": ("optimizer", {"type": "Muon", "params": {"betas": 0.9}},
                   ["optimizer.params.betas = 0.9: MuonWithAuxAdam takes a list of 2 numbers"]),
    "mup not installed": ("optimizer", {"type": "MuAdam", "params": {"lr": 1e-3}},
                          ["optimizer.type = 'muadam'", "not installed", "mup"]),
    "ZeRO stage 4": ("zero_optimization.stage", 4, ["stage = 4", "Input should be 0, 1, 2, 3"]),
    "ZeRO-3 all-reduce at cp 2": ("zero_optimization", {"stage": 3, "reduce_scatter": False},
                                  ["zero_optimization.reduce_scatter = false", "cp = 2", "allowed: true"]),
    "ZeRO key": ("zero_optimization.stagee", 1, ["stagee"]),
    "ZeRO-3 prescale": ("prescale_gradients", True, ["prescale_gradients = true with zero_optimization.stage = 3"]),
    "ZeRO-3 predivide": ("gradient_predivide_factor", 2.0, ["gradient_predivide_factor = 2.0 with zero_optimization"]),
    "ZeRO-3 NVMe": ("zero_optimization.offload_param", {"device": "nvme", "nvme_path": "/tmp"},
                    ["zero_optimization.offload_param.device = 'nvme' needs DeepSpeed's async I/O op"]),
    "infinite timeout": ("megatron_ring.collective_timeout_s", float("inf"),
                         ["megatron_ring.collective_timeout_s = inf", "finite number"]),
    "huge timeout": ("megatron_ring.collective_timeout_s", 1e300,
                     ["megatron_ring.collective_timeout_s = 1e+300", "less than or equal to 604800"]),
    "NaN peer timeout": ("megatron_ring.peer_timeout_s", float("nan"), ["megatron_ring.peer_timeout_s = nan"]),
    "missing held-out file": ("megatron_ring.eval", {"paths": ["../../nowhere.txt"]},
                              ["megatron_ring.eval.paths[0] = '../../nowhere.txt' does not exist"]),
    "empty held-out paths": ("megatron_ring.eval", {"paths": []}, ["megatron_ring.eval.paths", "at least 1 item"]),
    "eval key": ("megatron_ring.eval", {"paths": ["../../data/corpus/BSD.txt"], "intervall": 2},
                 ["intervall", "did you mean 'interval'"]),
}


def test_seq_len_of_any_length_is_padded_for_zigzag() -> None:
    """No "divisible by 2 * cp" rule: a row of 126 tokens at cp 2 runs padded to 128 (loss mask 0 there)."""
    spec = parse(changed(good(), "megatron_ring.seq_len", 126))
    assert spec.train.seq_len == 126 and spec.model.model.seq_length == 128
    data = TrainData(PackedSequences(torch.arange(300), 126), micro_batch=1, grad_accum=1, dp=1, dp_rank=0,
                     cp=2, cp_rank=0, shuffle=False, seed=0)
    batch = data.step_batches(0)[0]
    assert batch.tokens.shape == (1, 64) and float(batch.loss_mask.sum()) == 62  # chunks 0 and 3: 2 padding tokens


@pytest.mark.parametrize("case", list(BAD))
def test_bad_config_names_the_field(case: str) -> None:
    dotted, value, needles = BAD[case]
    raw = changed(good(), dotted, value)
    world = 3 if case == "heads vs tp" else 4
    if case == "heads vs tp":
        raw["train_batch_size"] = 4  # dp = 1
    if case.startswith("ZeRO-3 "):
        raw["zero_optimization"]["stage"] = 3
    if case == "ZeRO-3 NVMe" and async_io_available():
        pytest.skip("this DeepSpeed can build its async I/O op: NVMe offload is allowed here")
    with pytest.raises(ConfigError) as err:
        parse(raw, world_size=world)
    for needle in needles:
        assert needle in str(err.value), f"{needle!r} not in: {err.value}"


def test_train_main_stops_before_anything_starts(tmp_path: Path, monkeypatch: Any, capsys: Any) -> None:
    raw = changed(good(), "train_batch_size", 6)
    raw["megatron_ring"]["model"] = str(ROOT / "configs" / "megatron" / "tiny_ring_cp2.yaml")
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(raw))
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    assert train_main(["--deepspeed_config", str(path)]) == EXIT_CONFIG
    assert "train_batch_size = 6" in capsys.readouterr().err
    assert not torch.distributed.is_initialized()


def test_a_rank_takes_the_megatron_yaml_as_its_argument(tmp_path: Path, monkeypatch: Any, capsys: Any) -> None:
    """``torchrun -m megatron_ring.train CONFIG`` / ``deepspeed launch/train.py CONFIG`` (its ``--local_rank``
    too): the YAML with Megatron-LM's names, refused before anything starts naming its key; the config
    is given once."""
    text = (ROOT / "configs" / "train" / "megatron_pp2_cp2.yaml").read_text()
    path = tmp_path / "train.yaml"
    path.write_text(text.replace("../megatron/", f"{ROOT}/configs/megatron/").replace("../../", f"{ROOT}/")
                    .replace("global_batch_size: 8", "global_batch_size: 6"))
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    assert train_main([str(path), "--local_rank=0"]) == EXIT_CONFIG
    assert "global_batch_size = 6 is not divisible by micro_batch_size * data-parallel size = 4 * 1" in \
        capsys.readouterr().err
    assert not torch.distributed.is_initialized()
    with pytest.raises(SystemExit):
        train_main([str(path), "--deepspeed_config", str(path)])


def test_byte_tokenizer() -> None:
    tok = ByteTokenizer(128)
    ids = tok.encode("ring é")
    assert tok.eod_id == 127 and ids.tolist()[:4] == [ord(c) for c in "ring"]
    assert tok.decode(ids) == "ring ??" and int(ids.max()) < 128
    assert ByteTokenizer(300).eod_id == 256 and ByteTokenizer(300).decode(ByteTokenizer(300).encode("é")) == "é"


def test_batches_cover_the_global_batch_once_and_shard_zigzag() -> None:
    samples = PackedSequences(torch.arange(1000) % 97, seq_len=16)
    kw = dict(micro_batch=2, grad_accum=2, shuffle=True, seed=3)
    step = 5
    seen: list[int] = []
    for d in range(2):
        parts = [TrainData(samples, dp=2, dp_rank=d, cp=2, cp_rank=c, **kw).step_batches(step) for c in range(2)]
        ids = TrainData(samples, dp=2, dp_rank=d, cp=2, cp_rank=0, **kw).step_sample_ids(step)
        seen += [i for micro in ids for i in micro]
        for m, micro in enumerate(ids):
            full = {k: unshard_sequence([getattr(parts[c][m], k) for c in range(2)]) for k in ("tokens", "labels",
                                                                                                "position_ids")}
            rows = torch.stack([samples[i] for i in micro])
            assert torch.equal(full["tokens"], rows[:, :-1]) and torch.equal(full["labels"], rows[:, 1:])
            assert torch.equal(full["position_ids"], torch.arange(16).expand(2, -1))
    ref = TrainData(samples, dp=1, dp_rank=0, cp=1, cp_rank=0, micro_batch=8, grad_accum=1, shuffle=True, seed=3)
    assert sorted(seen) == sorted(ref.step_sample_ids(step)[0]), "dp x micro x accum must cover the global batch"
    again = TrainData(samples, dp=2, dp_rank=1, cp=2, cp_rank=1, **kw)
    assert again.step_sample_ids(step) == TrainData(samples, dp=2, dp_rank=1, cp=2, cp_rank=1, **kw).step_sample_ids(step)


def test_interrupted_checkpoint_is_never_latest(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None
    for step, complete in ((10, True), (20, True), (30, False)):
        tag = tmp_path / f"step{step:08d}"
        tag.mkdir()
        (tag / "mp_rank_00_model_states.pt").write_bytes(b"x")
        if complete:
            (tag / COMPLETE).write_text("{}")
    assert latest_checkpoint(tmp_path) == "step00000020"


def test_mpu_reports_dp_cp_for_gradients_and_dp_for_batches() -> None:
    layout = ParallelLayout(tp=2, cp=2, dp=2)
    rank = 5  # tp 1, cp 0, dp 1
    ranks = {axis: layout.group_of(axis, rank) for axis in ("tp", "cp", "dp", "pp", "dp-cp", "tp-cp")}
    groups = ParallelGroups(layout=layout, rank=rank, groups={a: a for a in ranks}, ranks=ranks)  # type: ignore
    mpu = DeepSpeedMPU(groups)
    assert (mpu.get_data_parallel_world_size(), mpu.get_sequence_parallel_world_size(),
            mpu.get_sequence_data_parallel_world_size(), mpu.get_model_parallel_world_size()) == (2, 2, 4, 2)
    assert mpu.get_sequence_data_parallel_group() == "dp-cp" and mpu.get_data_parallel_group() == "dp"
    assert ranks["dp-cp"] == [1, 3, 5, 7] and mpu.get_sequence_data_parallel_rank() == 2
    assert (mpu.get_tensor_model_parallel_rank(), mpu.get_data_parallel_rank(), mpu.get_sequence_parallel_rank()) \
        == (1, 1, 0)
    assert not hasattr(mpu, "initialize_sequence_parallel")


@pytest.mark.probe
def test_resume_refuses_other_data_or_batch(tmp_path: Path) -> None:
    spec = parse(good())
    kw = dict(micro_batch=2, grad_accum=2, dp=2, dp_rank=0, cp=2, cp_rank=0, shuffle=True, seed=1)
    data = TrainData(PackedSequences(torch.arange(2000) % 100, seq_len=128), **kw)
    client = {"step": 3, "consumed_samples": 3 * spec.global_batch, "data": data.fingerprint()}
    check_resume(client, data, spec, tmp_path)
    with pytest.raises(ConfigError, match="same global batch"):
        check_resume({**client, "consumed_samples": 12}, data, spec, tmp_path)
    changed = TrainData(PackedSequences(torch.arange(2001) % 100, seq_len=128), **kw)
    with pytest.raises(ConfigError, match="same corpus"):
        check_resume(client, changed, spec, tmp_path)


@pytest.mark.probe
def test_resume_refuses_changed_optimizer_settings_by_name(tmp_path: Path) -> None:
    """A resumed engine keeps the checkpoint's optimizer and schedule: a changed lr is refused, never ignored."""
    spec = parse(good())
    data = TrainData(PackedSequences(torch.arange(2000) % 100, seq_len=128), micro_batch=2, grad_accum=2, dp=2,
                     dp_rank=0, cp=2, cp_rank=0, shuffle=True, seed=1)
    client = {"step": 3, "consumed_samples": 3 * spec.global_batch, "data": data.fingerprint(),
              "settings": json.loads(json.dumps(optimizer_settings(spec)))}
    check_resume(client, data, spec, tmp_path)
    faster = parse(changed(good(), "optimizer.params.lr", 0.01))
    with pytest.raises(ConfigError, match=r"other optimizer settings.*optimizer: .*'lr': 0.003.* in the checkpoint, "
                                          r".*'lr': 0.01.* now.*Set them back"):
        check_resume(client, data, faster, tmp_path)


def test_every_problem_is_reported_at_once() -> None:
    raw = changed(good(), "train_batch_size", 6)
    raw = changed(raw, "megatron_ring.data.paths", ["../../nowhere"])
    raw = changed(raw, "gradient_clip", 1.0)
    raw = changed(raw, "optimizer.type", "AdamWW")
    raw = changed(raw, "zero_optimization", {"stage": 3, "reduce_scatter": False})
    raw = changed(raw, "bf16", {"enabled": True})
    with pytest.raises(ConfigError) as err:
        parse(raw)
    text = str(err.value)
    for needle in ("(6 problems)", "train_batch_size = 6", "megatron_ring.data.paths[0]", "gradient_clip",
                   "optimizer.type = 'AdamWW'", "reduce_scatter = false", "selects bf16"):
        assert needle in text, text


def test_outputs_must_be_writable_before_anything_runs(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    unwritable = "/proc/megatron_ring_no_such_dir/train.jsonl"  # no process can create it, root included
    raw = changed(good(), "megatron_ring.checkpoint.dir", str(blocker / "ckpt"))
    raw = changed(raw, "megatron_ring.log.jsonl", unwritable)
    with pytest.raises(ConfigError) as err:
        parse(raw)
    text = str(err.value)
    for needle in (f"megatron_ring.checkpoint.dir = '{blocker / 'ckpt'}': '{blocker}' is a file, not a directory",
                   f"megatron_ring.log.jsonl = '{unwritable}': cannot write in '/proc/megatron_ring_no_such_dir'"):
        assert needle in text, text
    raw = changed(good(), "megatron_ring.checkpoint.dir", str(tmp_path / "ckpt"))
    raw = changed(raw, "megatron_ring.log.jsonl", str(tmp_path / "logs" / "train.jsonl"))
    parse(raw)
    assert not list((tmp_path / "ckpt").iterdir()) and not list((tmp_path / "logs").iterdir())


@pytest.mark.probe
def test_a_new_run_never_writes_into_another_runs_checkpoints(tmp_path: Path) -> None:
    """resume: false into a folder holding step folders is refused (naming them) unless overwrite: true."""
    (tmp_path / "ckpt" / "step00000002").mkdir(parents=True)
    raw = changed(good(), "megatron_ring.checkpoint", {"dir": str(tmp_path / "ckpt"), "resume": False})
    with pytest.raises(ConfigError, match=r"checkpoint.resume = false but checkpoint.dir = .* holds another run's "
                                          r"checkpoints \(step00000002\).*checkpoint.overwrite: true"):
        parse(raw)
    parse(changed(raw, "megatron_ring.checkpoint.overwrite", True))
    parse(changed(raw, "megatron_ring.checkpoint.resume", True))
    parse(changed(raw, "megatron_ring.checkpoint.dir", str(tmp_path / "empty")))


def test_malformed_files_exit_2_naming_file_and_line(tmp_path: Path, monkeypatch: Any, capsys: Any) -> None:
    """A syntax error in the config or in the model YAML it names: exit 2, one message, no traceback."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(good(), indent=1).replace('"steps": 60', '"steps": 60,,'))
    assert train_main(["--deepspeed_config", str(path)]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "bad.json" in err and "is not valid JSON" in err and "line " in err and "Traceback" not in err, err
    model = tmp_path / "model.yaml"
    model.write_text((ROOT / "configs" / "megatron" / "tiny_ring_cp2.yaml").read_text() + "\n  - [unclosed\n")
    path.write_text(json.dumps(changed(good(), "megatron_ring.model", str(model))))
    assert train_main(["--deepspeed_config", str(path)]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "model.yaml" in err and "is not valid YAML" in err and "line " in err, err
    assert not torch.distributed.is_initialized()


def test_infinity_in_the_file_exits_2_before_anything_starts(tmp_path: Path, monkeypatch: Any, capsys: Any) -> None:
    raw = good()
    raw["megatron_ring"]["model"] = str(ROOT / "configs" / "megatron" / "tiny_ring_cp2.yaml")
    raw["megatron_ring"]["data"]["paths"] = [str(ROOT / "docs")]
    path = tmp_path / "inf.json"
    path.write_text(json.dumps(raw).replace('"seq_len"', '"collective_timeout_s": Infinity, "seq_len"'))
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    assert train_main(["--deepspeed_config", str(path)]) == EXIT_CONFIG
    assert "megatron_ring.collective_timeout_s = inf" in capsys.readouterr().err
    assert not torch.distributed.is_initialized()


def test_corpus_shorter_than_one_sample_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "tiny.txt").write_text("x" * 100)  # 101 tokens with the end of document
    raw = changed(good(), "megatron_ring.data.paths", [str(tmp_path / "tiny.txt")])
    with pytest.raises(ConfigError, match=r"hold 101 tokens \(1 files\), fewer than megatron_ring.seq_len \+ 1 = 129"):
        parse(raw)
    raw["megatron_ring"]["seq_len"] = 100
    assert parse(raw).train.seq_len == 100


def test_attention_dropout_is_a_config_error(tmp_path: Path) -> None:
    model = load_mapping(ROOT / "configs" / "megatron" / "tiny_ring_cp2.yaml")
    model["model"]["attention_dropout"] = 0.1
    (tmp_path / "m.json").write_text(json.dumps(model))
    raw = changed(good(), "megatron_ring.model", str(tmp_path / "m.json"))
    with pytest.raises(ConfigError, match=r"model.attention_dropout = 0.1 .*allowed: 0.0"):
        parse(raw)
