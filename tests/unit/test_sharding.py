"""Sharding and the per-step schedule: pure math, no process group."""
import pytest
import torch

from megatron_ring import shard_sequence, unshard_sequence
from megatron_ring.attention.schedule import StepPlan, schedule_for
from megatron_ring.attention.sharding import chunk_ids, local_positions


@pytest.mark.parametrize("sharding", ["zigzag", "contiguous"])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_shard_unshard_roundtrip(sharding, cp, dim):
    shape = [2, 3, 5]
    shape[dim] = 24
    x = torch.randn(*shape)
    parts = [shard_sequence(x, r, cp, dim=dim, sharding=sharding) for r in range(cp)]
    assert torch.equal(unshard_sequence(parts, dim=dim, sharding=sharding), x)


def test_zigzag_matches_megatron_split():
    # Megatron's get_batch_on_this_cp_rank: view as [2*cp, L/(2cp)], take chunks (r, 2cp-1-r).
    cp, seq = 4, 32
    tokens = torch.arange(seq)[None]
    for r in range(cp):
        expect = tokens.view(1, 2 * cp, -1).index_select(1, torch.tensor([r, 2 * cp - r - 1])).reshape(1, -1)
        assert torch.equal(shard_sequence(tokens, r, cp), expect)
        assert torch.equal(local_positions(seq, r, cp), expect[0])


def test_chunk_ids():
    assert chunk_ids(0, 2) == [0, 3] and chunk_ids(1, 2) == [1, 2]
    assert chunk_ids(1, 3, "contiguous") == [1]


@pytest.mark.parametrize("seq,cp,sharding", [(10, 3, "zigzag"), (12, 4, "zigzag"), (10, 3, "contiguous")])
def test_indivisible_sequence_is_a_clear_error(seq, cp, sharding):
    rule = "2\\*cp" if sharding == "zigzag" else "cp"
    with pytest.raises(ValueError, match=rf"sequence length {seq} is not divisible by {rule}"):
        shard_sequence(torch.zeros(1, seq), 0, cp, sharding=sharding)


def test_bad_rank_and_sharding():
    with pytest.raises(ValueError, match="cp_rank must be an int in \\[0, 2\\), got 2"):
        shard_sequence(torch.zeros(1, 8), 2, 2)
    with pytest.raises(ValueError, match="sharding must be one of \\['zigzag', 'contiguous'\\], got 'ring'"):
        shard_sequence(torch.zeros(1, 8), 0, 2, sharding="ring")


def _visible(cp, seq, causal, sharding):
    """Global (query, key) pairs the schedule computes, as a bool matrix; also work per (rank, step)."""
    seen = torch.zeros(seq, seq, dtype=torch.int64)
    work = torch.zeros(cp, cp, dtype=torch.int64)
    local = seq // cp
    for rank in range(cp):
        qpos = local_positions(seq, rank, cp, sharding)
        for step in range(cp):
            src = (rank - step) % cp
            kpos = local_positions(seq, src, cp, sharding)
            for plan in _plans(rank, src, cp, local, causal, sharding):
                qs, ks = qpos[plan.q], kpos[plan.k]
                block = torch.ones(len(qs), len(ks), dtype=torch.int64)
                if plan.causal:
                    block = block.tril()
                seen[qs[:, None], ks[None, :]] += block
                work[rank, step] += int(block.sum()) if plan.causal else block.numel()
    return seen, work


def _plans(rank: int, src: int, cp: int, local: int, causal: bool, sharding: str) -> tuple[StepPlan, ...]:
    return schedule_for(rank, cp, local, None, causal=causal, sharding=sharding, window=(-1, -1)).plans[src]


def _closed_form(rank: int, src: int, size: int, seq_local: int, causal: bool, sharding: str) -> StepPlan | None:
    """The plain schedule's step in closed form (Note [Causal zigzag: equal work at every step])."""
    everything = slice(0, seq_local)
    if not causal:
        return StepPlan(everything, everything, False)
    if src == rank:
        return StepPlan(everything, everything, True)
    if sharding == "contiguous":
        return StepPlan(everything, everything, False) if src < rank else None
    half = seq_local // 2
    if src < rank:
        return StepPlan(everything, slice(0, half), False)
    return StepPlan(slice(half, seq_local), everything, False)


@pytest.mark.parametrize("sharding", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("cp", [1, 2, 3, 4, 5])
def test_plain_schedule_is_one_closed_form_step_per_block(sharding, causal, cp):
    local = 12
    for rank in range(cp):
        for src in range(cp):
            expected = _closed_form(rank, src, cp, local, causal, sharding)
            assert _plans(rank, src, cp, local, causal, sharding) == (() if expected is None else (expected,))


@pytest.mark.parametrize("sharding", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("cp", [1, 2, 3, 4, 5])
def test_schedule_covers_each_visible_pair_exactly_once(sharding, causal, cp):
    seq = 4 * cp
    seen, _ = _visible(cp, seq, causal, sharding)
    expect = torch.ones(seq, seq, dtype=torch.int64)
    if causal:
        expect = expect.tril()
    assert torch.equal(seen, expect)


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_zigzag_causal_work_is_equal_on_every_rank_at_every_step(cp):
    _, work = _visible(cp, 4 * cp, True, "zigzag")
    for step in range(1, cp):
        assert len(set(work[:, step].tolist())) == 1, work
    _, contiguous = _visible(cp, 4 * cp, True, "contiguous")
    assert contiguous[0, 1:].sum() == 0 and contiguous[-1, 1:].min() > 0


@pytest.mark.parametrize("sharding", ["zigzag", "contiguous"])
@pytest.mark.parametrize("a2a_size,ring_size", [(1, 1), (2, 1), (3, 1), (4, 1), (2, 2), (3, 2), (2, 3)])
def test_a2a_runs_put_the_received_shards_in_ring_order(sharding, a2a_size, ring_size):
    from megatron_ring.attention.alltoall import _spans

    seq_local, size = 6, a2a_size * ring_size
    total = seq_local * size
    for ring_rank in range(ring_size):
        received = [local_positions(total, ring_rank * a2a_size + i, size, sharding) for i in range(a2a_size)]
        runs = _spans(seq_local, a2a_size, ring_size, ring_rank, sharding)
        assert [run.start for run in runs] == [0] + list(torch.tensor([r.length for r in runs]).cumsum(0)[:-1])
        tokens = torch.cat([received[r.member][r.offset:r.offset + r.length] for r in runs])
        assert torch.equal(tokens, local_positions(total, ring_rank, ring_size, sharding))
    if ring_size == 1:  # zigzag: each member's two chunks, the last member's merged; contiguous: one each
        assert len(runs) == (2 * a2a_size - 1 if sharding == "zigzag" else a2a_size)
