"""ParallelLayout: rank order, groups, validation (pure Python)."""
import pytest

from megatron_ring import ParallelLayout

LAYOUTS = [dict(tp=8, pp=2), dict(cp=16), dict(tp=2, cp=4, pp=2), dict(tp=4, cp=2, dp=2), dict(tp=2, cp=3, dp=2)]


@pytest.mark.parametrize("sizes", LAYOUTS)
def test_rank_formula_and_coords_roundtrip(sizes):
    layout = ParallelLayout(**sizes)
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        assert rank == c["tp"] + layout.tp * (c["cp"] + layout.cp * (c["dp"] + layout.dp * c["pp"]))
        assert layout.rank(**c) == rank


@pytest.mark.parametrize("sizes", LAYOUTS)
@pytest.mark.parametrize("axis", ["tp", "cp", "dp", "pp", "dp-cp", "tp-cp"])
def test_groups_partition_the_world(sizes, axis):
    layout = ParallelLayout(**sizes)
    groups = layout.groups(axis)
    flat = sorted(r for g in groups for r in g)
    assert flat == list(range(layout.world_size))
    size = 1
    for name in axis.split("-"):
        size *= getattr(layout, name)
    assert all(len(g) == size for g in groups)


def test_known_groups_tp2_cp4_pp2():
    layout = ParallelLayout(tp=2, cp=4, pp=2)
    assert layout.groups("tp")[:2] == [[0, 1], [2, 3]]
    assert layout.groups("cp")[:2] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert layout.groups("pp")[:2] == [[0, 8], [1, 9]]
    assert layout.group_of("cp", 13) == [9, 11, 13, 15]


@pytest.mark.parametrize("sizes", LAYOUTS)
def test_groups_equal_megatron_rank_generator(sizes):
    parallel_state = pytest.importorskip("megatron.core.parallel_state")
    layout = ParallelLayout(**sizes)
    gen = parallel_state.RankGenerator(tp=layout.tp, ep=1, dp=layout.dp, pp=layout.pp, cp=layout.cp,
                                       order="tp-cp-ep-dp-pp")
    for axis in ["tp", "cp", "dp", "pp", "dp-cp", "tp-cp"]:
        assert sorted(gen.get_ranks(axis)) == layout.groups(axis), axis


@pytest.mark.parametrize("field,value,exc", [
    ("tp", 0, ValueError), ("cp", -2, ValueError), ("dp", 1.5, TypeError), ("pp", "2", TypeError), ("tp", True, TypeError),
])
def test_bad_sizes_name_the_field(field, value, exc):
    with pytest.raises(exc, match=rf"ParallelLayout\.{field}.*{value!r}" if exc is TypeError else rf"ParallelLayout\.{field}"):
        ParallelLayout(**{field: value})


def test_world_size_mismatch_names_both_numbers():
    with pytest.raises(ValueError, match=r"layout world size 16 .*tp=8.*pp=2.* != process world size 4"):
        ParallelLayout(tp=8, pp=2).check_world_size(4)


def test_unknown_axis():
    with pytest.raises(ValueError, match="axis 'sp'"):
        ParallelLayout(cp=2).groups("sp")


def test_hierarchical_cp_groups_follow_megatron():
    """cp = a2a 2 x ring 2 inside each CP group (Megatron's hierarchical_context_parallel_sizes = [2, 2]:
    level-1 groups of adjacent CP ranks, level-2 groups strided by the level-1 size)."""
    layout = ParallelLayout(tp=2, cp=4, cp_a2a=2)
    assert layout.hierarchical_groups("cp-a2a") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.hierarchical_groups("cp-ring") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.cp_ring == 2 and "(cp = a2a 2 x ring 2)" in layout.describe()
    flat = ParallelLayout(cp=8, cp_a2a=4)
    assert flat.hierarchical_groups("cp-a2a") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert flat.hierarchical_groups("cp-ring") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_hierarchical_cp_groups_equal_megatron_helper():
    parallel_state = pytest.importorskip("megatron.core.parallel_state")
    einops = pytest.importorskip("einops")
    import numpy as np

    layout = ParallelLayout(cp=8, cp_a2a=2)
    sizes = [2, 4]
    for level, name in enumerate(("cp-a2a", "cp-ring")):
        expected = einops.rearrange(np.array(range(8)), "(l s u) -> (l u) s", u=int(np.prod(sizes[:level])),
                                    s=sizes[level], l=int(np.prod(sizes[level + 1:]))).tolist()
        assert sorted(expected) == layout.hierarchical_groups(name), name
    assert parallel_state.create_hierarchical_groups  # the helper this mirrors


@pytest.mark.parametrize("cp,cp_a2a,match", [(4, 3, r"cp_a2a \(3\) must divide cp \(4\)"), (4, 0, r"cp_a2a")])
def test_bad_hierarchical_sizes(cp, cp_a2a, match):
    with pytest.raises(ValueError, match=match):
        ParallelLayout(cp=cp, cp_a2a=cp_a2a)
    with pytest.raises(ValueError, match="no hierarchical CP groups"):
        ParallelLayout(cp=4).hierarchical_groups("cp-a2a")


@pytest.mark.parametrize("sizes", [dict(tp=2, cp=3, dp=2, pp=2), dict(cp=5), dict(tp=3, dp=2)])
@pytest.mark.parametrize("axis", ["tp", "cp", "dp", "pp", "dp-cp", "tp-cp"])
def test_group_of_and_ring_neighbours_agree_with_groups(sizes, axis):
    layout = ParallelLayout(**sizes)
    for members in layout.groups(axis):
        for i, rank in enumerate(members):
            assert layout.group_of(axis, rank) == members
            if "-" not in axis:
                assert layout.ring_neighbours(rank, axis) == (members[i - 1], members[(i + 1) % len(members)])


def test_layout_table_is_linear_in_the_world(monkeypatch):
    """The CLI's table computes a bounded number of ranks per rank (it rebuilt every group for every rank)."""
    from megatron_ring import cli

    calls = [0]
    real = ParallelLayout.rank

    def counted(self, **coords):
        calls[0] += 1
        return real(self, **coords)

    monkeypatch.setattr(ParallelLayout, "rank", counted)
    per_rank = []
    for cp in (500, 2000):
        calls[0] = 0
        table = cli._layout_table(ParallelLayout(cp=cp, tp=2))
        assert table.count("\n") > 2 * cp
        per_rank.append(calls[0] / (2 * cp))
    assert per_rank[1] <= per_rank[0] + 1 and per_rank[1] < 12, per_rank
