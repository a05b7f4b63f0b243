"""transformers models with ring attention on gloo: logits and greedy generate equal single process.

Tiny Llama, Qwen2 and Mistral (GQA 4/2 heads, RoPE, random weights). Each CP size runs every case
in one call on a shared pool; the parent compares with single-process ``eager`` and ``sdpa``.
Logits: fp32 relative error <= 1e-5 on the real (non-padding) tokens. Tokens: exactly equal.
RoPE types with fixed frequencies (linear, llama3, yarn) are exact at cp 2; models that the ring
would get silently wrong (length-dependent RoPE, attention outside ``AttentionInterface``) are refused.
"""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")
pytestmark = pytest.mark.pool_family("frameworks")

from megatron_ring.hf import cp_context, enable_ring_attention, ring_forward, ring_generate  # noqa: E402
from megatron_ring.attention.reference import rel_err  # noqa: E402
from megatron_ring.testing.gloo import runs_per_size  # noqa: E402
from megatron_ring.testing.tiny_hf import (  # noqa: E402
    BOS_ID, EOS_ID, FAMILIES, PAD_ID, VOCAB_SIZE, check_matches_eager, check_refused, sample_prompts, tiny_model,
)

TOL = 1e-5
NEW_TOKENS = 5
RUN_TIMEOUT_S = 600  # the first call on a pool imports transformers (and deepspeed) on every rank


def _prompts() -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    return sample_prompts(seed=1)


def run_cases() -> dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]]:
    """On every rank: (logits, generated ids) per (family, prompt) under the world as CP group."""
    out = {}
    for family in FAMILIES:
        model = tiny_model(family, attn_implementation="ring")
        for name, (ids, mask) in _prompts().items():
            logits = ring_forward(model, ids, mask)
            tokens = ring_generate(model, ids, mask, max_new_tokens=NEW_TOKENS)
            out[family, name] = (logits, tokens)
    return out


def run_autotp_cases() -> dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]]:
    """On every rank of a world of 4: DeepSpeed AutoTP over tp=2, ring attention over cp=2."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from megatron_ring import ParallelLayout, init_parallel
    from megatron_ring.hf import init_autotp

    groups = init_parallel(ParallelLayout(tp=2, cp=2))
    out = {}
    for family in FAMILIES:
        model = init_autotp(tiny_model(family, attn_implementation="ring"), groups.tp, {"dtype": "fp32"})
        for name, (ids, mask) in _prompts().items():
            out[family, name] = (ring_forward(model, ids, mask, group=groups.cp),
                                 ring_generate(model, ids, mask, group=groups.cp, max_new_tokens=NEW_TOKENS))
    return out


FIXED_ROPE: dict[str, dict] = {
    # prompts of 16 (+ NEW_TOKENS) tokens run past original_max_position_embeddings=8
    "linear": dict(rope_parameters={"rope_type": "linear", "factor": 2.0}),
    "llama3": dict(rope_parameters={"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8},
                   max_position_embeddings=16),
    "yarn": dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8},
                 max_position_embeddings=16),
}


def run_rope_cases() -> dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]]:
    """On every rank: (logits, generated ids) per (rope type, prompt) of a tiny Llama under the world as CP group."""
    out = {}
    for rope, overrides in FIXED_ROPE.items():
        model = tiny_model("llama", attn_implementation="ring", **overrides)
        for name, (ids, mask) in _prompts().items():
            out[rope, name] = (ring_forward(model, ids, mask), ring_generate(model, ids, mask, max_new_tokens=NEW_TOKENS))
    return out


def _tiny_hf_model(config_class: str, attn_implementation: str, **fields):
    """A tiny random ``*ForCausalLM`` of another family (2 layers, hidden 64, 4 heads, our byte vocabulary)."""
    import transformers

    config = getattr(transformers, config_class)(vocab_size=VOCAB_SIZE, hidden_size=64, bos_token_id=BOS_ID,
                                                 eos_token_id=EOS_ID, pad_token_id=PAD_ID, **fields)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).eval()


def dynamic_llama(attn_implementation: str):
    """Dynamic-NTK RoPE whose frequencies grow past max_position_embeddings=8 (the test prompts have 16 tokens)."""
    return tiny_model("llama", attn_implementation=attn_implementation, max_position_embeddings=8,
                      rope_parameters={"rope_type": "dynamic", "factor": 2.0})


def longrope_phi3(attn_implementation: str):
    """Phi-3 longrope: the long factors apply past original_max_position_embeddings=12 (head_dim 16: 8 factors);
    at cp 2 a 16-token prompt puts positions 4..11 on rank 1, which alone would pick the short factors."""
    return _tiny_hf_model("Phi3Config", attn_implementation, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=48,
                          original_max_position_embeddings=12,
                          rope_parameters={"rope_type": "longrope", "short_factor": [1.0 + i / 8 for i in range(8)],
                                           "long_factor": [2.0 + i for i in range(8)]})


def bloom(attn_implementation: str):
    """Bloom (ALiBi): loads with any attn_implementation, but its attention never calls AttentionInterface."""
    return _tiny_hf_model("BloomConfig", attn_implementation, n_layer=2, n_head=4)


def falcon(attn_implementation: str):
    """Falcon: picks its attention class from a dict of its own (no AttentionInterface)."""
    return _tiny_hf_model("FalconConfig", attn_implementation, num_hidden_layers=2, num_attention_heads=4)


@pytest.fixture(scope="module")
def cp_results(gloo_pool):
    return runs_per_size(gloo_pool, run_cases, RUN_TIMEOUT_S)


@pytest.fixture(scope="module")
def references():
    """(logits per attn implementation, generated ids) per (family, prompt), single process."""
    refs = {}
    for family in FAMILIES:
        models = {impl: tiny_model(family, attn_implementation=impl) for impl in ("eager", "sdpa")}
        for name, (ids, mask) in _prompts().items():
            with torch.no_grad():
                logits = {impl: m(ids, attention_mask=mask).logits for impl, m in models.items()}
                tokens = models["eager"].generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False)
            refs[family, name] = (logits, tokens, mask)
    return refs


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_generate_match_single_process(cp_results, references, size, family):
    per_rank = cp_results(size)
    for name in ("plain", "padded"):
        ref_logits, ref_tokens, mask = references[family, name]
        real = mask.bool() if mask is not None else torch.ones(ref_tokens.shape[0], 16, dtype=torch.bool)
        for rank, results in enumerate(per_rank):
            logits, tokens = results[family, name]
            for impl, expected in ref_logits.items():
                err = rel_err(logits[real], expected[real])
                assert err <= TOL, f"{family} {name} cp={size} rank {rank} vs {impl}: rel err {err:.2e}"
            assert torch.equal(tokens, ref_tokens), f"{family} {name} cp={size} rank {rank}: {tokens} != {ref_tokens}"


def test_rope_with_fixed_frequencies_matches_single_process(gloo_pool):
    per_rank = gloo_pool(2).run(run_rope_cases, timeout_s=RUN_TIMEOUT_S)
    for rope, overrides in FIXED_ROPE.items():
        eager = tiny_model("llama", attn_implementation="eager", **overrides)
        check_matches_eager(eager, _prompts(), per_rank, rope, f"rope {rope} cp=2", new_tokens=NEW_TOKENS, tol=TOL)


def hybrid_lfm2(attn_implementation: str):
    """LFM2: a convolution layer (state along the sequence, outside attention) before an attention layer."""
    return _tiny_hf_model("Lfm2Config", attn_implementation, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, layer_types=["conv", "full_attention"])


@pytest.mark.parametrize("build, match", [
    (dynamic_llama, r"rope_type='dynamic' is not supported with ring attention"),
    (longrope_phi3, r"rope_type='longrope' is not supported with ring attention"),
    (bloom, r"BloomForCausalLM is not supported with ring attention: its attention does not .*AttentionInterface"),
    (falcon, r"FalconForCausalLM is not supported with ring attention: its attention does not .*AttentionInterface"),
    (hybrid_lfm2, r"config.layer_types contains \['conv'\], which ring attention does not compute"),
], ids=["dynamic-rope", "longrope", "bloom", "falcon", "hybrid-conv"])
@pytest.mark.parametrize("entry", ["load", "enable_ring_attention", "ring_forward", "ring_generate"])
def test_silently_wrong_models_are_refused(build, match, entry):
    """Refused at load with attn_implementation="ring" (Note [Refusing at load]), and, for a model loaded
    with another implementation, by every entry point, before any collective, so on every rank alike."""
    check_refused(build, match, entry, _prompts()["plain"][0], NEW_TOKENS)


def test_supported_models_load_and_switch_to_ring():
    """The load-time refusal leaves every other request alone: a Llama loads with "ring" and switches to sdpa."""
    model = tiny_model("llama", attn_implementation="ring")
    assert model.config._attn_implementation == "ring"
    model.set_attn_implementation("sdpa")
    assert model.config._attn_implementation == "sdpa"
    assert enable_ring_attention(model).config._attn_implementation == "ring"


def test_autotp_tp2_x_cp2_matches_single_process(gloo_pool, references):
    pytest.importorskip("deepspeed")
    per_rank = gloo_pool(4).run(run_autotp_cases, timeout_s=RUN_TIMEOUT_S)
    for (family, name), (ref_logits, ref_tokens, mask) in references.items():
        real = mask.bool() if mask is not None else torch.ones_like(ref_tokens[:, :16], dtype=torch.bool)
        for rank, results in enumerate(per_rank):
            logits, tokens = results[family, name]
            err = rel_err(logits[real], ref_logits["eager"][real])
            assert err <= TOL, f"{family} {name} tp2 x cp2 rank {rank}: rel err {err:.2e}"
            assert torch.equal(tokens, ref_tokens), f"{family} {name} tp2 x cp2 rank {rank}: {tokens} != {ref_tokens}"


@pytest.mark.parametrize("family", FAMILIES)
def test_single_process_ring_matches_eager(references, family):
    model = tiny_model(family, attn_implementation="ring")
    for name, (ids, mask) in _prompts().items():
        ref_logits, ref_tokens, _ = references[family, name]
        real = mask.bool() if mask is not None else torch.ones_like(ids, dtype=torch.bool)
        assert rel_err(ring_forward(model, ids, mask)[real], ref_logits["eager"][real]) <= TOL
        assert torch.equal(ring_generate(model, ids, mask, max_new_tokens=NEW_TOKENS), ref_tokens)


def test_cp_context_forward_is_differentiable():
    ids = _prompts()["plain"][0]
    ring, eager = (tiny_model("qwen2", attn_implementation=impl) for impl in ("ring", "eager"))
    with cp_context():
        ring(ids, position_ids=torch.arange(16)[None]).logits.square().mean().backward()
    eager(ids).logits.square().mean().backward()
    for (name, p_ring), p_eager in zip(ring.named_parameters(), eager.parameters()):
        assert rel_err(p_ring.grad, p_eager.grad) <= 1e-4, name


def test_sliding_window_that_covers_the_sequence_is_exact():
    ids = _prompts()["plain"][0]
    ring = tiny_model("mistral", attn_implementation="ring", sliding_window=32)
    eager = tiny_model("mistral", attn_implementation="eager", sliding_window=32)
    with torch.no_grad():
        assert rel_err(ring_forward(ring, ids), eager(ids).logits) <= TOL
        assert torch.equal(ring_generate(ring, ids, max_new_tokens=NEW_TOKENS),
                           eager.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False))


@pytest.mark.parametrize("call, match", [
    (lambda m, ids: ring_forward(tiny_model("llama", attn_implementation="ring", is_causal=False), ids),
     r"causal decoder-only .*is_causal=False"),
    (lambda m, ids: ring_forward(tiny_model("llama", attn_implementation="eager"), ids),
     r"attn_implementation='eager'.*'ring'"),
    (lambda m, ids: ring_forward(tiny_model("llama", attn_implementation="ring", attention_dropout=0.1).train(), ids),
     r"dropout must be 0 with ring attention, got 0.1"),
    (lambda m, ids: ring_generate(m, ids, max_new_tokens=2, output_attentions=True, return_dict_in_generate=True),
     r"output_attentions=True"),
    (lambda m, ids: ring_forward(m, ids[0]), r"input_ids must be a 2-D tensor"),
    (lambda m, ids: ring_forward(m, ids, torch.ones(2, 3)), r"attention_mask must be a 2-D tensor shaped like"),
], ids=["non-causal", "not-ring", "dropout", "output-attentions", "1d-ids", "mask-shape"])
def test_unsupported_cases_raise_clear_errors(call, match):
    model = tiny_model("llama", attn_implementation="ring")
    with pytest.raises(ValueError, match=match):
        call(model, _prompts()["plain"][0])


def test_output_attentions_and_missing_context_raise():
    model = tiny_model("llama", attn_implementation="ring")
    ids = _prompts()["plain"][0]
    with pytest.raises(ValueError, match="output_attentions=True is not supported"), cp_context():
        model(ids, output_attentions=True)
    with pytest.raises(RuntimeError, match="needs a context-parallel context"):
        model(ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_enable_ring_attention_switches_implementation(family):
    model = enable_ring_attention(tiny_model(family, attn_implementation="sdpa"))
    assert model.config._attn_implementation == "ring"
    with pytest.raises(TypeError, match="PreTrainedModel"):
        enable_ring_attention(torch.nn.Linear(2, 2))
