"""torch.compile on gloo at cp 2 (and 3): ring_attention, decode_attention and a tiny transformers model.

Note [torch.compile] in megatron_ring/attention/ops.py. Compiling on CPU is slow, so these tests are
few and small: one uses the default inductor backend, the others ``aot_eager`` / ``eager`` (the
same dynamo graphs, breaks and guards, no code generation).
"""
import pytest

from tests.gloo import compile_workers

pytestmark = pytest.mark.slow
COMPILE_TIMEOUT_S = 480  # inductor on two busy CPU cores


@pytest.mark.parametrize(("size", "backend", "padded"), [(2, "inductor", True), (2, "aot_eager", False),
                                                        (3, "aot_eager", True)])
def test_compiled_ring_attention_equals_eager(gloo_pool, size, backend, padded):
    """fullgraph=True, no graph break; forward and q/k/v gradients as eager (causal, GQA, with and
    without a key padding mask; an odd ring too)."""
    per_rank = gloo_pool(size).run(compile_workers.ring_compiled_vs_eager, backend, padded,
                                   timeout_s=COMPILE_TIMEOUT_S)
    for rank, result in enumerate(per_rank):
        assert result.pop("graph_breaks") == 0
        for name, diff in result.items():
            assert diff <= 1e-6, f"rank {rank} {name}: compiled differs from eager by {diff:.2e}"


def test_compiled_decode_compiles_once_as_the_cache_grows(gloo_pool):
    for result in gloo_pool(2).run(compile_workers.decode_steps_compiled, timeout_s=COMPILE_TIMEOUT_S):
        assert result == {"diff": 0.0, "graphs": 1, "graph_breaks": 0}


def test_handshake_still_names_the_mismatch_on_every_rank(gloo_pool):
    for message in gloo_pool(2).run(compile_workers.mismatched_call_under_compile, timeout_s=COMPILE_TIMEOUT_S):
        assert "causal differs across the CP group: rank [0] has True, rank [1] has False" in message


def test_compiled_tiny_llama_gives_eager_logits(gloo_pool):
    """The whole model forward is one graph (fullgraph=True) with the ring inside; padded batch."""
    for result in gloo_pool(2).run(compile_workers.hf_compiled_logits, "aot_eager", timeout_s=COMPILE_TIMEOUT_S):
        assert result["graph_breaks"] == 0
        assert result["vs_eager"] <= 1e-6
        assert result["vs_single"] <= 1e-4


def test_compiled_generate_stops_compiling_after_two_decode_steps(gloo_pool):
    """Same tokens as eager; graphs: prefill, a decode step that keeps the new token on this rank and
    one that does not; no recompilation after that, nor in a second, longer generate."""
    for result in gloo_pool(2).run(compile_workers.hf_compiled_generate, timeout_s=COMPILE_TIMEOUT_S):
        assert result["same"] == [True, True]
        assert result["graph_breaks"] == 0
        first, second = result["graphs"]
        assert first[1] == 3, result["graphs"]
        assert set(first[1:]) | set(second) == {3}, result["graphs"]
