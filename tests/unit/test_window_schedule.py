"""The window / packed-document schedule (pure): exact coverage, trimming, skipping, transfers."""
import itertools

import pytest
import torch

from megatron_ring.attention import schedule as schedule_module
from megatron_ring.attention.schedule import rank_schedule
from megatron_ring.attention.sharding import (doc_lengths, local_positions, rank_segments, shard_sequence,
                                              unshard_sequence)
from megatron_ring.attention.call import check_window
from megatron_ring.attention.window import Band, band_limits, is_windowed


def _cu(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def _allowed(lengths, causal, window):
    """Global packed [T, T] bool: same document and inside the window (the definition)."""
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.cat([torch.arange(n) for n in lengths])
    d = pos[:, None] - pos[None, :]
    ok = doc[:, None] == doc[None, :]
    left, right = window
    if left >= 0:
        ok &= d <= left
    if right >= 0:
        ok &= d >= -right
    if causal:
        ok &= d >= 0
    return ok


def _global_rows(rank, size, lengths, sharding):
    """Global packed index of each local row of ``rank``."""
    return shard_sequence(torch.arange(sum(lengths)), rank, size, dim=0, sharding=sharding, cu_seqlens=_cu(lengths))


def _schedules(size, lengths, causal, window, sharding):
    lo, hi = band_limits(window if is_windowed(window, causal, max(lengths)) else (-1, -1), causal)
    segments = [rank_segments(r, size, lengths, sharding) for r in range(size)]
    return [rank_schedule(r, size, segments, lo, hi) for r in range(size)]


CASES = [
    ([16], True, (3, 0)), ([16], True, (-1, -1)), ([16], False, (2, 5)), ([16], False, (-1, 0)),
    ([8, 24, 0, 16], True, (5, 0)), ([8, 24, 16], True, (-1, -1)), ([8, 24, 16], False, (-1, -1)),
    ([8, 24, 16], False, (4, 1)), ([32], True, (0, 0)), ([32], True, (100, 0)),
]


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("sharding", ["zigzag", "contiguous"])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{'causal' if c[1] else 'full'}-{c[2]}" for c in CASES])
def test_plans_cover_each_allowed_pair_exactly_once(size, sharding, case):
    _check_coverage(size, sharding, *case)


@pytest.mark.parametrize("size", [1, 2, 3])
@pytest.mark.parametrize("case", [c for c in CASES if c[2] != (-1, -1)][:5], ids=[str(i) for i in range(5)])
def test_band_tiles_cover_each_allowed_pair_exactly_once(monkeypatch, size, case):
    """Banded pairs longer than BAND_TILE are cut into tiles; most of them run unmasked."""
    monkeypatch.setattr(schedule_module, "BAND_TILE", 3)
    _check_coverage(size, "zigzag", *case)


def _check_coverage(size, sharding, base, causal, window):
    lengths = [n * size for n in base]
    total = sum(lengths)
    seen = torch.zeros(total, total, dtype=torch.int64)
    schedules = _schedules(size, lengths, causal, window, sharding)
    for rank, schedule in enumerate(schedules):
        rows = _global_rows(rank, size, lengths, sharding)
        for src in range(size):
            cols = _global_rows(src, size, lengths, sharding)
            for plan in schedule.plans[src]:
                nq, nk = plan.q.stop - plan.q.start, plan.k.stop - plan.k.start
                if plan.band is not None:
                    block = plan.band.visible(nq, nk, torch.device("cpu"))
                elif plan.causal:
                    block = torch.ones(nq, nk, dtype=torch.bool).tril()
                else:
                    block = torch.ones(nq, nk, dtype=torch.bool)
                # trimmed: every row sees a key (of the plan), every column is seen
                assert bool(block.any(1).all()) and bool(block.any(0).all()), plan
                seen[rows[plan.q][:, None], cols[plan.k][None, :]] += block.long()
    assert torch.equal(seen, _allowed(lengths, causal, window).long())


@pytest.mark.parametrize("size", [2, 3, 4, 5])
@pytest.mark.parametrize("sharding", ["zigzag", "contiguous"])
@pytest.mark.parametrize("case", CASES[:8], ids=[str(i) for i in range(8)])
def test_sends_pair_with_receives(size, sharding, case):
    """What rank r sends at step t is exactly what rank r + t receives at step t."""
    base, causal, window = case
    schedules = _schedules(size, [n * size for n in base], causal, window, sharding)
    for rank, t in itertools.product(range(size), range(1, size)):
        assert schedules[rank].send_rows[t] == schedules[(rank + t) % size].recv_rows[t]
        used = schedules[rank].recv_rows[t]
        src = (rank - t) % size
        assert (used is None) == (schedules[rank].plans[src] == ())


def test_window_skips_steps_and_rows():
    """P = 4, causal, L = 64 (zigzag chunks of 8), window of one chunk: each rank reads at most two
    half blocks from its neighbours; contiguous sharding needs only the previous rank's tail."""
    zigzag = _schedules(4, [64], True, (7, 0), "zigzag")
    for schedule in zigzag:
        used = [r for r in schedule.recv_rows[1:] if r is not None]
        assert len(used) <= 2 and all(r.stop - r.start <= 8 for r in used)
    contiguous = _schedules(4, [64], True, (7, 0), "contiguous")
    for rank, schedule in enumerate(contiguous):
        expect = [None, slice(9, 16) if rank > 0 else None, None, None]
        assert list(schedule.recv_rows) == [slice(0, 16)] + expect[1:]


def test_packed_documents_cost_one_call_per_document_and_step():
    """Causal zigzag, no window: full pieces merge, so each step has one plan per document."""
    lengths = [8, 16, 8, 24]
    for schedule in _schedules(4, lengths, True, (-1, -1), "zigzag"):
        assert all(len(plans) == len(lengths) for plans in schedule.plans)
        assert all(p.band is None for plans in schedule.plans for p in plans)


def test_a_window_longer_than_the_sequence_changes_nothing():
    assert not is_windowed((63, 0), True, 64) and not is_windowed((-1, 100), False, 64)
    assert is_windowed((62, 0), True, 64) and is_windowed((-1, 62), False, 64) and is_windowed((5, -1), False, 64)


def test_band_visible_matches_its_definition():
    band = Band(offset=3, lo=-1, hi=4)
    vis = band.visible(5, 7, torch.device("cpu"))
    for i, j in itertools.product(range(5), range(7)):
        assert bool(vis[i, j]) == (-1 <= 3 + i - j <= 4)


@pytest.mark.parametrize("sharding", ["zigzag", "contiguous"])
def test_varlen_shard_round_trip_and_positions(sharding):
    lengths = [6, 12, 0, 6]
    cu = _cu(lengths)
    x = torch.arange(24)[:, None].expand(24, 3)
    parts = [shard_sequence(x, r, 3, dim=0, sharding=sharding, cu_seqlens=cu) for r in range(3)]
    assert torch.equal(unshard_sequence(parts, dim=0, sharding=sharding, cu_seqlens=cu), x)
    pos = torch.cat([torch.arange(n) for n in lengths])
    for r in range(3):
        assert torch.equal(local_positions(24, r, 3, sharding, cu_seqlens=cu), pos[parts[r][:, 0]])
    if sharding == "zigzag":  # rank 0: chunks 0 and 5 of every document (THD convention)
        assert parts[0][:, 0].tolist() == [0, 5, 6, 7, 16, 17, 18, 23]


def test_bad_cu_seqlens_and_window():
    x = torch.zeros(16, 2)
    with pytest.raises(ValueError, match="cu_seqlens.dtype is torch.int64; allowed: torch.int32"):
        shard_sequence(x, 0, 2, dim=0, cu_seqlens=torch.tensor([0, 16]))
    with pytest.raises(ValueError, match=r"cu_seqlens must be non-decreasing, got cu_seqlens\[1\] = 12 > cu_seqlens\[2\] = 8"):
        shard_sequence(x, 0, 2, dim=0, cu_seqlens=_cu([12, -4, 8]))
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        shard_sequence(x, 0, 2, dim=0, cu_seqlens=torch.tensor([4, 16], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\] = 12 must equal the global packed token count 16"):
        shard_sequence(x, 0, 2, dim=0, cu_seqlens=_cu([12]))
    with pytest.raises(ValueError, match="document 1 has 6 tokens, not divisible by 2\\*cp = 4 .* pad every document"):
        shard_sequence(x, 0, 2, dim=0, cu_seqlens=_cu([8, 6, 2]))
    with pytest.raises(TypeError, match="cu_seqlens must be an int32 torch.Tensor"):
        doc_lengths([0, 16], 16, 2, "zigzag")  # type: ignore[arg-type]
    for bad in [(-2, 0), (1, 2, 3), 4, (1.0, 0), (True, 0), None]:
        with pytest.raises(ValueError, match="window_size must be a pair"):
            check_window(bad)
