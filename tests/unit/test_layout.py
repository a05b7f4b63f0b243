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
