"""Probe sweep, 2 gloo processes: API calls that ranks disagree on, checkpoints that cannot be
trusted, start-up faults; and the issue-27 cases other changes own, as expected failures."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.gloo import workers
from tests.probe.harness import ROOT, slow, train_config

MODEL = "mp_rank_00_model_states.pt"


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_ring_attention_matches_float64(gloo_pool: Any, causal: bool) -> None:
    for rank, errs in enumerate(gloo_pool(2).run(workers.ring_vs_reference, 16, 4, 2, 8, causal, "zigzag", "p2p",
                                                 torch.float32, "auto")):
        assert max(errs.values()) < 1e-5, f"rank {rank}: silently wrong result {errs}"


@pytest.mark.parametrize("field", ["seq", "causal", "dtype", "comm"])
def test_ranks_disagreeing_get_a_value_error_each(gloo_pool: Any, field: str) -> None:
    outcomes = gloo_pool(2).run(workers.mismatched_call, "ring", field, [1], timeout_s=60)
    assert all(kind == "ValueError" and field in text for kind, text in outcomes), outcomes


def test_gradients_needed_on_one_rank_only_is_a_value_error_on_each(gloo_pool: Any) -> None:
    """q.requires_grad on one rank alone once left the backward waiting to the collective timeout."""
    outcomes = gloo_pool(2).run(workers.mismatched_call, "ring", "requires_grad", [1], timeout_s=60)
    assert all(kind == "ValueError" and "gradients differs across the CP group" in text for kind, text in outcomes), \
        outcomes


@pytest.mark.parametrize("where", ["ring_attention", "megatron"])
def test_packed_boundaries_out_of_order_name_the_ordering(where: str) -> None:
    cu = torch.tensor([0, 12, 8, 16], dtype=torch.int32)
    if where == "megatron":
        pytest.importorskip("megatron.core")
        from megatron.core.packed_seq_params import PackedSeqParams

        from megatron_ring.integrations.megatron.packed import thd_layout

        with pytest.raises(ValueError, match=r"cu_seqlens_q = \[0, 12, 8, 16\] must be non-decreasing: "
                                             r"cu_seqlens_q\[1\] = 12 > cu_seqlens_q\[2\] = 8"):
            thd_layout(PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu), 16, 0, 1, None)
        return
    from megatron_ring import ring_attention

    q = torch.randn(16, 2, 8)
    with pytest.raises(ValueError, match=r"cu_seqlens must be non-decreasing, got cu_seqlens\[1\] = 12 > "
                                         r"cu_seqlens\[2\] = 8"):
        ring_attention(q, q, q, cu_seqlens=cu)


@pytest.mark.parametrize("change,what", [("prompt", "the prompt (input_ids) differs"),
                                         ("max_new_tokens", "the generation arguments differ")])
def test_ring_generate_called_differently_is_a_value_error_on_each(gloo_pool: Any, change: str, what: str) -> None:
    """Different prompts of one shape once gave wrong tokens; different max_new_tokens hung."""
    pytest.importorskip("transformers")
    from tests.integration import hf_generate_workers

    errors = gloo_pool(2).run(hf_generate_workers.mismatched_generate, change, timeout_s=120)
    assert all(e is not None and what in e and "CP ranks [[0], [1]]" in e for e in errors), errors


@pytest.mark.parametrize("shape", [(2, 0), (0, 16)])
@pytest.mark.parametrize("entry", ["ring_forward", "ring_generate"])
def test_empty_input_ids_are_a_value_error_naming_the_shape(entry: str, shape: tuple[int, int]) -> None:
    pytest.importorskip("transformers")
    from megatron_ring import hf
    from megatron_ring.testing.tiny_hf import tiny_model

    model = tiny_model("llama", attn_implementation="ring")
    kwargs = {"max_new_tokens": 2} if entry == "ring_generate" else {}
    with pytest.raises(ValueError, match=rf"input_ids has shape \({shape[0]}, {shape[1]}\); the ring needs batch >= 1"):
        getattr(hf, entry)(model, torch.zeros(shape, dtype=torch.long), **kwargs)


def test_zero_head_dim_is_a_value_error_naming_it(gloo_pool: Any) -> None:
    outcomes = gloo_pool(2).run(workers.zero_sized, "ring", "head_dim", "auto", timeout_s=60)
    assert all(o[0] == "ValueError" and "head_dim" in o[1] for o in outcomes), outcomes


def _run_training(pool: Any, raw: dict[str, Any], **kw: Any) -> list[dict[str, Any]]:
    from tests.integration import train_workers

    return pool.run(train_workers.run_or_refuse, raw, str(ROOT), timeout_s=240, **kw)


def _flip(path: Path, count: int = 4096) -> None:
    data = bytearray(path.read_bytes())
    start = len(data) // 3
    data[start:start + count] = bytes(b ^ 0xFF for b in data[start:start + count])
    path.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def step1_checkpoint(gloo_pool: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One training step's checkpoint folder, made once for the module's corrupted-checkpoint cases
    (each works on a copy of its own: :func:`_checkpoint_after_one_step`)."""
    pytest.importorskip("deepspeed")
    folder = tmp_path_factory.mktemp("step1")
    _run_training(gloo_pool(2), train_config(folder, steps=1))
    return folder / "ckpt"


def _checkpoint_after_one_step(step1: Path, tmp_path: Path) -> None:
    """``tmp_path / "ckpt"`` as ``train_config(tmp_path, steps=1)`` leaves it (a copy of the module's)."""
    shutil.copytree(step1, tmp_path / "ckpt")


def test_bit_flipped_checkpoint_is_refused_naming_the_file(gloo_pool: Any, step1_checkpoint: Path,
                                                           tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    pool = gloo_pool(2)
    _checkpoint_after_one_step(step1_checkpoint, tmp_path)
    tag = tmp_path / "ckpt" / "step00000001"
    _flip(tag / MODEL)
    results = _run_training(pool, train_config(tmp_path, steps=2))
    assert all("CheckpointError" in r.get("error", "") and str(tag / MODEL) in r["error"] for r in results), results
    assert not (tmp_path / "ckpt" / "step00000002").exists()


def test_nan_loss_from_an_unverified_checkpoint_stops_and_saves_nothing(gloo_pool: Any, step1_checkpoint: Path,
                                                                        tmp_path: Path) -> None:
    """The issue's case: a checkpoint without digests (older format), 4096 bytes XORed in the model states."""
    pytest.importorskip("deepspeed")
    pool = gloo_pool(2)
    _checkpoint_after_one_step(step1_checkpoint, tmp_path)
    tag = tmp_path / "ckpt" / "step00000001"
    marker = json.loads((tag / "complete.json").read_text())
    del marker["files"]
    (tag / "complete.json").write_text(json.dumps(marker))
    data = bytearray((tag / MODEL).read_bytes())  # NaN bit patterns over the middle of the weights
    start = len(data) // 2
    data[start:start + 4096] = b"\xff" * 4096
    (tag / MODEL).write_bytes(bytes(data))
    results = _run_training(pool, train_config(tmp_path, steps=3))
    errors = {r.get("error") for r in results}
    assert len(errors) == 1 and next(iter(errors)) is not None, results
    error = next(iter(errors))
    assert "TrainingStopped: step " in error and "the global loss is nan" in error, error
    bad = int(error.split("TrainingStopped: step ")[1].split(":")[0])
    assert not (tmp_path / "ckpt" / f"step{bad:08d}").exists(), f"the NaN step {bad} was saved"


@slow
def test_truncated_checkpoint_is_refused_naming_the_file(gloo_pool: Any, tmp_path: Path) -> None:
    pool = gloo_pool(2)
    _run_training(pool, train_config(tmp_path, steps=1))
    path = tmp_path / "ckpt" / "step00000001" / MODEL
    path.write_bytes(path.read_bytes()[:1000])
    results = _run_training(pool, train_config(tmp_path, steps=2))
    assert all(str(path) in r.get("error", "") and "has 1000 bytes" in r["error"] for r in results), results


@slow
def test_resume_at_another_layout_names_both(gloo_pool: Any, tmp_path: Path) -> None:
    pool = gloo_pool(2)
    _run_training(pool, train_config(tmp_path, steps=1))
    raw = train_config(tmp_path, steps=2, layout={"cp": 1, "dp": 2})
    raw["train_batch_size"] = 2
    results = _run_training(pool, raw)
    assert all("cp=2 x dp=1" in r.get("error", "") and "cp=1 x dp=2" in r["error"] for r in results), results


def test_rank_stopped_before_the_monitor_attaches() -> None:
    from tests.unit.test_peer_monitor import test_peer_lost_before_the_monitor_attaches_ends_the_rendezvous as case

    case(1, "stop")


@slow
def test_rank_stopped_at_launch_under_the_deepspeed_launcher(tmp_path: Path) -> None:
    from tests.integration.test_hung_rank import test_rank_stopped_at_start_up_stops_the_job as case

    case(tmp_path, 1)


@pytest.mark.parametrize("new_tokens", [1, 3])
def test_model_generate_in_a_bare_cp_context_is_refused_on_every_rank(gloo_pool: Any, new_tokens: int) -> None:
    """With one new token it once returned wrong tokens that differed between ranks."""
    pytest.importorskip("transformers")
    from tests.probe import hf_workers

    outcomes = gloo_pool(2).run(hf_workers.generate_in_bare_context, new_tokens, timeout_s=120)
    assert all(kind == "ValueError" and "must run through megatron_ring.hf.ring_generate" in text
               for kind, text in outcomes), outcomes


@pytest.mark.parametrize("inputs", ["global", "no positions"])
def test_a_forward_on_inputs_that_are_no_shard_is_refused_on_every_rank(gloo_pool: Any, inputs: str) -> None:
    """The global ids passed as the local shard once gave logits 40-70 % off, and no error."""
    pytest.importorskip("transformers")
    from tests.probe import hf_workers

    results = gloo_pool(2).run(hf_workers.forward_in_bare_context, inputs, timeout_s=120)
    assert all(kind == "ValueError" and "position_ids inside cp_context are not those of zigzag shards" in text
               for (kind, text), _ in results), results


def test_a_forward_on_a_documented_shard_is_exact(gloo_pool: Any) -> None:
    pytest.importorskip("transformers")
    from tests.probe import hf_workers

    for (kind, text), err in gloo_pool(2).run(hf_workers.forward_in_bare_context, "shard", timeout_s=120):
        assert kind == "ok", text
        assert err is not None and err < 1e-6, err


def test_a_model_error_on_one_rank_reaches_the_other_at_once(gloo_pool: Any) -> None:
    """GPT-2 over a prompt past n_positions: rank 0 (which holds the last tokens) fails in its position
    embedding before the ring's handshake; rank 1 once waited there to the collective timeout and aborted."""
    pytest.importorskip("transformers")
    from tests.probe import hf_workers

    (first, first_s), (second, second_s) = gloo_pool(2).run(hf_workers.gpt2_past_its_positions, 16, 20, timeout_s=120)
    assert first[0] == "IndexError" and "the other ranks of the CP group were told" in first[1], first
    assert second[0] == "ValueError" and "rejected on rank [0] (rank 0: IndexError" in second[1], second
    assert max(first_s, second_s) < 20, (first_s, second_s)


def test_checkpoint_save_on_a_full_file_system_names_the_cause(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once "iostream error" or "Parent directory ... does not exist"; `latest` stays on the last complete step."""
    pytest.importorskip("deepspeed")
    from tests.integration.test_train_checkpoint import test_write_failures_name_the_real_cause as case

    case(tmp_path, monkeypatch)


def test_decode_runs_the_handshake_on_its_first_step_only(gloo_pool: Any) -> None:
    """Note [Decode handshake once] in integrations/hf/cache.py: later steps repeat the first one's call."""
    pytest.importorskip("transformers")
    from tests.probe import hf_workers

    for steps in gloo_pool(2).run(hf_workers.decode_handshakes, 4, timeout_s=120):
        assert len(steps) == 4 and all(steps[0]) and not any(flag for step in steps[1:] for flag in step), steps
