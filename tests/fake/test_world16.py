"""init_parallel at world size 16 on the fake backend (one process, no data moves: topology only)."""
import pytest
import torch.distributed as dist

from megatron_ring import ParallelLayout, init_parallel
from megatron_ring.testing.fake import init_fake_world

LAYOUTS = {"tp8_pp2": dict(tp=8, pp=2), "cp16": dict(cp=16), "tp2_cp4_pp2": dict(tp=2, cp=4, pp=2),
           "tp4_cp2_dp2": dict(tp=4, cp=2, dp=2)}
RANKS = [0, 5, 10, 15]


@pytest.fixture
def fake_world():
    def start(rank):
        init_fake_world(16, rank=rank)
    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("rank", RANKS)
def test_groups_match_layout(fake_world, name, rank):
    fake_world(rank)
    layout = ParallelLayout(**LAYOUTS[name])
    groups = init_parallel(layout)
    for axis in ["tp", "cp", "dp", "pp", "dp-cp"]:
        expect = layout.group_of(axis, rank)
        assert groups.ranks[axis] == expect
        assert dist.get_process_group_ranks(groups.groups[axis]) == expect
    ring = layout.group_of("cp", rank)
    assert groups.cp_size == layout.cp and ring[groups.cp_rank] == rank
    assert groups.ring_next == ring[(groups.cp_rank + 1) % layout.cp]
    assert groups.ring_prev == ring[(groups.cp_rank - 1) % layout.cp]


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("rank", [0, 13])
def test_groups_match_megatron_initialize_model_parallel(fake_world, name, rank):
    parallel_state = pytest.importorskip("megatron.core.parallel_state")
    fake_world(rank)
    layout = ParallelLayout(**LAYOUTS[name])
    ours = init_parallel(layout)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp, create_gloo_process_groups=False,
    )
    try:
        theirs = {
            "tp": parallel_state.get_tensor_model_parallel_group(),
            "cp": parallel_state.get_context_parallel_group(),
            "dp": parallel_state.get_data_parallel_group(),
            "pp": parallel_state.get_pipeline_model_parallel_group(),
            "dp-cp": parallel_state.get_data_parallel_group(with_context_parallel=True),
        }
        for axis, group in theirs.items():
            assert dist.get_process_group_ranks(group) == ours.ranks[axis], axis
    finally:
        parallel_state.destroy_model_parallel()


def test_layout_must_fill_the_world(fake_world):
    fake_world(0)
    with pytest.raises(ValueError, match="layout world size 8 .* != process world size 16"):
        init_parallel(ParallelLayout(tp=2, cp=4))
