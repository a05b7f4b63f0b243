"""Dilated attention's pure parts: head phases, compact runs, the pieces' plans (exact coverage of
the definition, each pair once), and the checks at the boundary."""
import pytest
import torch

from megatron_ring import ring_attention
from megatron_ring.attention.dilated import check_dilation, compact_runs, phase_heads
from megatron_ring.attention.dilated_schedule import dilated_schedule_for, row_index
from megatron_ring.attention.reference import attention_reference, dilated_reference, rel_err
from megatron_ring.attention.sharding import local_positions, rank_segments


@pytest.mark.parametrize("heads_q,heads_kv,r",
                         [(8, 8, 4), (8, 2, 4), (8, 2, 3), (4, 1, 3), (6, 3, 4), (4, 4, 1)])
def test_phases_cover_every_head_once_in_valid_gqa_groups(heads_q, heads_kv, r):
    seen = []
    g = heads_q // heads_kv
    for phase in range(r):
        q, kv, groups = phase_heads(heads_q, heads_kv, r, phase)
        assert list(range(q.start, q.stop)) == [h for h in range(heads_q) if h * r // heads_q == phase]
        assert [h for grp in groups for h in range(grp.q.start, grp.q.stop)] == list(range(q.start, q.stop))
        for grp in groups:
            nq, nkv = grp.q.stop - grp.q.start, grp.kv.stop - grp.kv.start
            assert nq % nkv == 0 and kv.start <= grp.kv.start and grp.kv.stop <= kv.stop
            per_kv = nq // nkv
            assert all((grp.q.start + i) // g == grp.kv.start + i // per_kv for i in range(nq))
        seen += range(q.start, q.stop)
    assert seen == list(range(heads_q))


@pytest.mark.parametrize("size,sharding",
                         [(1, "zigzag"), (2, "zigzag"), (3, "zigzag"), (4, "contiguous"), (3, "contiguous")])
@pytest.mark.parametrize("w,r", [(5, 1), (12, 2), (7, 3), (100, 4), (4, 4)])
def test_compact_runs_are_the_phase_tokens_in_position_order(size, sharding, w, r):
    seq = 24 * size
    for rank in range(size):
        pos = local_positions(seq, rank, size, sharding if size > 1 else "contiguous")
        segments = rank_segments(rank, size, (seq,), sharding if size > 1 else "contiguous")
        for phase in range(r):
            runs = compact_runs(segments, w, r, phase)
            rows = row_index(runs, torch.device("cpu"))
            picked = pos[rows]
            expected = sorted(int(p) for p in pos if (p % w) % r == phase)
            assert picked.tolist() == expected
            compact = [(run.segment.doc, run.segment.pos + i) for run in runs for i in range(run.segment.length)]
            assert compact == [(p // w, (p % w) // r) for p in expected]
            starts = [sum(x.segment.length for x in runs[:i]) for i in range(len(runs))]
            assert [run.segment.local for run in runs] == starts


def _meets(seq, heads_q, pairs, causal):
    """bool [pieces..., heads, seq, seq] by the definition, one entry per (pair, phase)."""
    pos = torch.arange(seq)
    out = []
    for w, r in pairs:
        for phase in range(r):
            on = (pos % w) % r == phase
            meet = on[:, None] & on[None, :] & ((pos // w)[:, None] == (pos // w)[None, :])
            out.append(meet & (pos[:, None] >= pos[None, :]) if causal else meet)
    return out


@pytest.mark.parametrize("size,sharding",
                         [(1, "zigzag"), (2, "zigzag"), (3, "zigzag"), (4, "zigzag"), (3, "contiguous")])
@pytest.mark.parametrize("causal", [True, False])
def test_plans_cover_the_definition_exactly_once(size, sharding, causal):
    seq, pairs = 24 * size, ((5, 1), (12, 2), (7, 3), (1000, 4))
    layout = sharding if size > 1 else "contiguous"
    pos = [local_positions(seq, r, size, layout) for r in range(size)]
    for i, meet in enumerate(_meets(seq, 4, pairs, causal)):
        count = torch.zeros(seq, seq, dtype=torch.int64)
        for rank in range(size):
            piece = dilated_schedule_for(rank, size, seq // size, 4, 2, pairs, causal=causal, sharding=sharding)[i]
            mine = pos[rank][row_index(piece.runs[rank], torch.device("cpu"))]
            for src in range(size):
                theirs = pos[src][row_index(piece.runs[src], torch.device("cpu"))]
                for plan in piece.schedule.plans[src]:
                    assert plan.band is None
                    qp, kp = mine[plan.q], theirs[plan.k]
                    hit = torch.ones(len(qp), len(kp), dtype=torch.int64)
                    if plan.causal:
                        hit = hit.tril()
                    count[qp[:, None], kp[None, :]] += hit
        assert count.max() <= 1 and torch.equal(count.bool(), meet), f"piece {i}"


def test_reference_reduces_to_plain_and_per_phase_attention():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 24, 4, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    plain = attention_reference(q, k, v, causal=True)
    assert rel_err(dilated_reference(q, k, v, ((24, 1),), causal=True), plain) < 1e-12
    out = dilated_reference(q, k, v, ((12, 2),), causal=False)
    for seg in (0, 12):
        for h in range(4):
            rows = torch.arange(seg + h * 2 // 4, seg + 12, 2)
            one = attention_reference(q[:, rows, h:h + 1], k[:, rows, h:h + 1], v[:, rows, h:h + 1])
            assert rel_err(out[:, rows, h:h + 1], one) < 1e-12
            others = torch.tensor([x for x in range(seg, seg + 12) if x not in rows.tolist()])
            assert out[:, others, h].abs().max() == 0


@pytest.mark.parametrize("dilation,match", [
    ((0, 1), "ints >= 1"), ([], "non-empty"), ("(4, 2)", "non-empty"), (((4, 2), (8, 2.0)), "ints >= 1"),
    (((4, 5),), "exceeds heads_q"), ((True, 1), "ints >= 1"),
])
def test_bad_dilation_names_the_field(dilation, match):
    q = torch.randn(1, 8, 4, 8)
    with pytest.raises(ValueError, match="dilation") as err:
        ring_attention(q, q, q, causal=True, dilation=dilation)
    assert match.split()[0] in str(err.value)


@pytest.mark.parametrize("extra,name", [({"window_size": (2, 0)}, "window_size"),
                                        ({"key_padding_mask": torch.ones(1, 8, dtype=torch.bool)}, "key_padding_mask"),
                                        ({"comm": "a2a"}, "comm='a2a'")])
def test_dilation_rejects_what_it_does_not_combine_with(extra, name):
    q = torch.randn(1, 8, 4, 8)
    with pytest.raises(ValueError, match=f"dilation does not combine with {name}"):
        ring_attention(q, q, q, causal=True, dilation=((4, 2),), **extra)


def test_check_dilation_takes_one_pair_or_a_sequence():
    assert check_dilation((8, 2), 4, {}) == ((8, 2),)
    assert check_dilation([[8, 2], (16, 4)], 4, {}) == ((8, 2), (16, 4))
    assert check_dilation(None, 4, {"window_size": True}) is None


def test_a_plain_call_runs_no_dilated_code():
    """The dilated machinery stays off the plain path (it only adds one None check there)."""
    import sys

    q = torch.randn(1, 16, 2, 8, requires_grad=True)
    ring_attention(q, q, q, causal=True)  # schedules cached, as in a steady state
    entered = set()

    def profile(frame, event, arg):
        if event == "call" and "/attention/dilated" in frame.f_code.co_filename:
            entered.add(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        ring_attention(q, q, q, causal=True).sum().backward()
    finally:
        sys.setprofile(None)
    assert not entered, entered
