"""turn_attention (a follow-up turn against a sharded KV cache), pass-KV and pass-Q, vs float64 on gloo."""
from __future__ import annotations

import pytest
import torch

from megatron_ring.costs.comm_choice import DEFAULT_COSTS
from megatron_ring.attention.turn import turn_attention, turn_times
from tests.gloo import turn_workers

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("heads", [(4, 2), (3, 3)])
def test_turn_matches_reference(gloo_pool, size, heads):
    per_rank = gloo_pool(size).run(turn_workers.turn_vs_reference, *heads, 8, ["pass_kv", "pass_q", "auto"])
    for results in per_rank:
        for r in results:
            assert r["err"] <= TOL[r["dtype"]], r
            assert r["out_dtype"] == r["dtype"] and r["shape"] == r["want"], r


def test_ranks_disagreeing_on_the_mode_all_raise(gloo_pool):
    for message in gloo_pool(2).run(turn_workers.mismatched_mode):
        assert "mode differs" in message and "'pass_kv'" in message and "'pass_q'" in message


def test_bad_arguments_are_named():
    x = torch.randn(1, 3, 2, 4)
    with pytest.raises(ValueError, match="mode must be one of"):
        turn_attention(x, x, x, q_positions=torch.arange(3), k_positions=torch.arange(3), mode="ring")
    with pytest.raises(ValueError, match="right must be 0"):
        turn_attention(x, x, x, q_positions=torch.arange(3), k_positions=torch.arange(3), window_size=(4, 2))
    with pytest.raises(ValueError, match=r"k_positions must be an int32/int64 tensor \[s_local\] = \[3\]"):
        turn_attention(x, x, x, q_positions=torch.arange(3), k_positions=torch.arange(2))


def test_cost_model_switches_from_pass_q_to_pass_kv_as_the_turn_grows():
    """A short question after a long cache moves its queries; a turn as long as the cache moves K/V."""
    costs = DEFAULT_COSTS["cuda"]
    shape = dict(kv_tokens=100_000, cp_size=8, batch=1, heads_q=32, heads_kv=8, head_dim=128, element_size=2)
    short = turn_times(costs, new_tokens=64, **shape)
    long = turn_times(costs, new_tokens=100_000, **{**shape, "kv_tokens": 200_000})
    assert short.mode == "pass_q" and short.pass_q_s < short.pass_kv_s
    assert long.mode == "pass_kv" and long.pass_kv_s <= long.pass_q_s


@pytest.mark.parametrize("size", [1, 3])
@pytest.mark.parametrize("left", [-1, 4])
def test_decode_rows_matches_reference(gloo_pool, size, left):
    """Rows with caches of 1 to 30 tokens, split unevenly (empty shards too), one all-gather for all of them."""
    for results in gloo_pool(size).run(turn_workers.decode_rows_vs_reference, 4, 2, 8, [1, 7, 30], left):
        for r in results:
            assert r["err"] <= TOL[r["dtype"]] and r["out_dtype"] == r["dtype"], r
