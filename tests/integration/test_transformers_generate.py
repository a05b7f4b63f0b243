"""Every generation mode of ``ring_generate`` on gloo is token-identical to single-process ``generate``.

Tiny Llama (``megatron_ring.testing.tiny_hf``), cp 2 and 4, left-padded batches whose length is not
a multiple of ``2 * cp``: greedy, beam search (2 and 4 beams), seeded sampling (top-k, top-p,
temperature, beam sampling, several return sequences), ``use_cache=False`` (each step a ring
prefill), logits processors and stopping criteria, streamers on rank 0 only. One pool call per CP
size runs every case (``hf_generate_workers.run_generation_cases``).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytestmark = pytest.mark.pool_family("frameworks")

from megatron_ring.hf import cp_context, ring_generate  # noqa: E402
from megatron_ring.testing.gloo import runs_per_size  # noqa: E402
from megatron_ring.testing.tiny_hf import tiny_model  # noqa: E402
from tests.integration.hf_generate_workers import (  # noqa: E402
    BANNED, CASES, NEW_TOKENS, generate, prompts, run_generation_cases, sampled_logits, streamed,
)

RUN_TIMEOUT_S = 600  # the first call on a pool imports transformers on every rank


@pytest.fixture(scope="module")
def eager():
    return tiny_model("llama", attn_implementation="eager")


@pytest.fixture(scope="module")
def ring_results(gloo_pool):
    return runs_per_size(gloo_pool, run_generation_cases, RUN_TIMEOUT_S)


@pytest.mark.parametrize("size", [2, 4])
def test_every_mode_matches_single_process_generate(ring_results, eager, size):
    per_rank = ring_results(size)
    for name in CASES:
        expected = generate(eager, name, ring=False)
        for rank, results in enumerate(per_rank):
            assert torch.equal(results[name], expected), f"{name} cp={size} rank {rank}: {results[name]} != {expected}"
    assert per_rank[0]["processors"].shape[1] == 13 + 3  # the stopping criterion saw the unpadded length
    assert not (per_rank[0]["processors"][:, 13:] == BANNED).any()


@pytest.mark.parametrize("size", [2, 4])
def test_sampling_draws_the_same_tokens_from_bitwise_equal_logits(ring_results, eager, size):
    """Note [Sampling over a CP group]: same seed, bitwise-equal logits on every rank, the single-process tokens."""
    per_rank = ring_results(size)
    expected_tokens, expected_logits = sampled_logits(eager, ring=False)
    tokens0, logits0 = per_rank[0]["sampled_logits"]
    assert torch.equal(tokens0, expected_tokens)
    assert torch.allclose(logits0, expected_logits, rtol=1e-4, atol=1e-4)
    for rank, results in enumerate(per_rank[1:], start=1):
        tokens, logits = results["sampled_logits"]
        assert torch.equal(tokens, tokens0) and torch.equal(logits, logits0), f"cp={size} rank {rank} differs"


@pytest.mark.parametrize("size", [2, 4])
def test_streamer_on_rank_0_and_processors_see_the_unpadded_sequence(ring_results, eager, size):
    per_rank = ring_results(size)
    expected = streamed(eager, ring=False, on_this_rank=True)
    got = per_rank[0]["streamed"]
    assert torch.equal(got["collect_tokens"], expected["collect_tokens"])
    assert torch.equal(got["text_tokens"], expected["text_tokens"])
    assert len(got["puts"]) == len(expected["puts"]) == 1 + NEW_TOKENS and got["ended"] == 1
    assert all(torch.equal(a, b) for a, b in zip(got["puts"], expected["puts"]))
    assert got["text"] == expected["text"]
    for results in per_rank[1:]:  # no streamer there, same tokens
        assert torch.equal(results["streamed"]["collect_tokens"], expected["collect_tokens"])
        assert "puts" not in results["streamed"]
    assert per_rank[0]["processor_lengths"] == list(range(13, 13 + NEW_TOKENS))


@pytest.mark.parametrize("size", [2, 4])
def test_sampling_with_different_seeds_raises_on_every_rank(ring_results, size):
    for rank, results in enumerate(ring_results(size)):
        assert results["seed_error"] is not None, f"rank {rank} did not raise"
        assert "the random state differs" in results["seed_error"]
        assert "torch.manual_seed" in results["seed_error"]


def test_single_process_ring_matches_generate(eager):
    ring = tiny_model("llama", attn_implementation="ring")
    for name in ("greedy", "beams4", "sample-top-p", "no-cache-beams2", "processors"):
        assert torch.equal(generate(ring, name, ring=True), generate(eager, name, ring=False)), name


@pytest.mark.parametrize("new_tokens", [1, 2])
def test_generate_inside_a_bare_cp_context_points_to_ring_generate(new_tokens: int):
    """With one new token there is no second step whose shapes would not fit: it once returned wrong tokens."""
    model = tiny_model("llama", attn_implementation="ring")
    with pytest.raises(ValueError, match=r"model.generate on a model with attn_implementation='ring' must run "
                                         r"through megatron_ring.hf.ring_generate"), cp_context():
        model.generate(prompts()["plain"][0], max_new_tokens=new_tokens)
    with pytest.raises(ValueError, match=r"must run through megatron_ring.hf.ring_generate"):
        model.generate(prompts()["plain"][0], max_new_tokens=new_tokens)


@pytest.mark.parametrize("kwargs, match", [
    ({"prefill_chunk_size": 4}, r"prefill_chunk_size=4 is not supported"),
    ({"prompt_lookup_num_tokens": 2}, r"generation mode 'assisted_generation'.*allowed: \['greedy_search'"),
    ({"cache_implementation": "static"}, r"cache_implementation='static', allowed: None"),
    ({"output_hidden_states": True, "return_dict_in_generate": True}, r"output_hidden_states=True is not supported"),
    ({"past_key_values": object()}, r"does not take 'past_key_values'"),
    ({"inputs_embeds": torch.zeros(2, 16, 64)}, r"does not take 'inputs_embeds'"),
], ids=["chunked-prefill", "assisted", "cache-implementation", "hidden-states", "past-key-values", "inputs-embeds"])
def test_unsupported_generate_arguments_raise(kwargs, match):
    model = tiny_model("llama", attn_implementation="ring")
    with pytest.raises(ValueError, match=match):
        ring_generate(model, prompts()["plain"][0], max_new_tokens=2, **kwargs)
