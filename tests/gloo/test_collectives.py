"""The p2p path is a true ring: P-1 rotations forward, no K/V all-gather anywhere.

With ``check_consistency=True`` (the default) each call adds one all-gather of ``WIDTH`` = 24
int64s (192 bytes) per rank before any data moves (Note [Cross-rank handshake]); backward adds
nothing."""
import pytest
import torch

from megatron_ring.costs.comm_choice import DEFAULT_COSTS, relay_pieces
from megatron_ring.costs.traffic import p2p_forward_messages

from megatron_ring.testing.gloo import GlooPool, WorkerError
from tests.gloo import workers


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
def test_p2p_forward_issues_p_minus_1_rotations_and_no_all_gather(gloo_pool, size, causal, check):
    worker = workers.count_collectives if check else workers.count_collectives_unchecked
    for forward, backward in gloo_pool(size).run(worker, "p2p", causal):
        assert forward == {"p2p_batches": size - 1, "all_gather": int(check)}  # the handshake's all-gather
        # backward: P-1 K/V rotations + P gradient transfers (the last one carries dK/dV home)
        assert backward == {"p2p_batches": 2 * size - 1, "all_gather": 0}


@pytest.mark.parametrize("heads_kv,seq_local,pieces,expected", [
    (1, 4, 2, 1), (2, 4, 2, 2), (3, 4, 2, 1), (2, 4, None, 1), (3, 4096, None, 1), (2, 4096, None, 2)],
    ids=["set-mqa", "set-2", "set-3", "chosen-short", "chosen-long-3", "chosen-long-2"])
def test_p2p_forward_sends_one_message_per_head_group_and_hop(gloo_pool, heads_kv, seq_local, pieces, expected):
    """The relay's forward moves a block in g head groups, one message each per hop (Note [Forward memory]):
    ``comm_choice.PIECES = 2`` gives gcd(2, heads_kv); unset, the cost model (Note [Pieces per hop], CPU profile) keeps
    whole blocks at 4 tokens per rank (a gloo message's 200 us against microseconds of compute) and halves them at
    4,096 where heads_kv is even; the same count as comm_choice's latency term."""
    size = 3
    shape = dict(seq_local=seq_local, cp_size=size, batch=1, heads_q=2 * heads_kv, heads_kv=heads_kv, head_dim=4,
                 causal=True, element_size=4)
    chosen = relay_pieces(**shape, costs=DEFAULT_COSTS["cpu"], override=pieces)
    assert chosen == expected
    for forward, backward in gloo_pool(size).run(workers.count_collectives, "p2p", True, heads_kv, pieces, seq_local):
        assert forward["p2p_batches"] == p2p_forward_messages(size, chosen) == expected * (size - 1)
        assert backward == {"p2p_batches": 2 * size - 1, "all_gather": 0}  # whole blocks


def test_a_plain_p2p_forward_runs_code_in_eight_files(gloo_pool):
    """The reading path of one call (docs/design.md): a steady-state ``ring_attention(q, k, v, causal=True)`` runs
    code in 8 files of the project, GQA included; nothing else joins them unnoticed."""
    for files in gloo_pool(2).run(workers.files_of_a_warm_call, 2):
        assert files == ["attention/api.py", "attention/block.py", "attention/call.py", "attention/handshake.py",
                         "attention/relay.py", "attention/ring.py", "attention/sdpa_backend.py",
                         "attention/transport.py"], files


@pytest.mark.parametrize("check", [True, False], ids=["checked", "unchecked"])
def test_all_gather_path_gathers_once(gloo_pool, check):
    """On gloo the K/V gather is one batch of pairwise transfers (Note [Pairwise gather on gloo]);
    the handshake keeps its all-gather collective."""
    worker = workers.count_collectives if check else workers.count_collectives_unchecked
    forward, backward = gloo_pool(3).run(worker, "all_gather", True)[0]
    assert forward == {"p2p_batches": 1, "all_gather": int(check)}
    assert backward == {"p2p_batches": 1, "all_gather": 0}  # K/V gathered again; gradients go by reduce


def test_ranks_disagreeing_on_shapes_fail_instead_of_hanging():
    pool = GlooPool(3, timeout_s=60, env={})
    try:
        with pytest.raises(WorkerError, match=r"(?s)failed on ranks \[0, 1, 2\].*seq_local differs across the CP group"):
            pool.run(workers.mismatched_shapes, timeout_s=60)
    finally:
        pool.close(force=True)


@pytest.mark.parametrize("size", [2, 3])
def test_auto_comm_is_exact(gloo_pool, size):
    per_rank = gloo_pool(size).run(workers.ring_vs_reference, 4 * size, 4, 2, 5, True, "zigzag", "auto",
                                   torch.float32, "auto")
    assert max(max(e.values()) for e in per_rank) <= 1e-5


def test_indivisible_global_length_is_rejected_on_every_rank(gloo_pool):
    for message in gloo_pool(2).run(workers.odd_local_length_error):
        assert message is not None and "global sequence length (seq_local 3 x cp 2) 6 is not divisible by 2*cp = 4" in message


def test_pairwise_gather_stacks_blocks_in_group_order(gloo_pool):
    """Note [Pairwise gather on gloo]: peers are addressed by global rank, blocks land in group order,
    and each source's block has its own receives to wait on (none for the rank's own)."""
    for rank, results in enumerate(gloo_pool(4).run(workers.gather_blocks_in_strided_groups)):
        (pair_ok, pair_arrivals), (world_ok, world_arrivals) = results
        assert pair_ok and world_ok
        assert pair_arrivals == ([0, 2] if rank < 2 else [2, 0])
        assert world_arrivals == [0 if src == rank else 2 for src in range(4)]
