"""The comm="auto" rule on the pure cost model (no torch.distributed)."""
from __future__ import annotations

import configparser
import json
from pathlib import Path

import pytest

from megatron_ring.costs import comm_choice
from megatron_ring.costs.comm_choice import (
    DEFAULT_COSTS, DEFAULT_PROFILES, CommCosts, choose_comm, choose_comm_for_shapes, crossover_tokens, predict_times,
    profile_costs, relay_pieces,
)

COSTS = CommCosts(flops_per_s=500e12, p2p_bytes_per_s=400e9, allgather_bytes_per_s=400e9,
                  step_latency_s=20e-6, collective_latency_s=30e-6)
SHAPE = dict(batch=1, heads_q=32, heads_kv=32, head_dim=128, element_size=2)


def test_crossover_matches_formula() -> None:
    # bf16: c* = (F/W) * (H_kv/H) / alpha
    assert crossover_tokens(COSTS, heads_q=32, heads_kv=32, causal=False, element_size=2) == pytest.approx(1250)
    assert crossover_tokens(COSTS, heads_q=32, heads_kv=32, causal=True, element_size=2) == pytest.approx(2500)
    assert crossover_tokens(COSTS, heads_q=32, heads_kv=8, causal=True, element_size=2) == pytest.approx(625)
    assert crossover_tokens(COSTS, heads_q=32, heads_kv=32, causal=False, element_size=4) == pytest.approx(2500)


def test_ring_wins_above_crossover() -> None:
    for seq_local in (2500, 8192, 65536):
        choice = choose_comm(seq_local=seq_local, cp_size=8, causal=True, costs=COSTS, **SHAPE)
        assert choice.comm == "p2p"
        assert choice.p2p_s <= choice.all_gather_s


def test_all_gather_wins_when_latency_dominates() -> None:
    choice = choose_comm(seq_local=16, cp_size=16, causal=True, costs=COSTS, **SHAPE)
    assert choice.comm == "all_gather"
    assert "latency" in choice.reason


def test_without_fixed_costs_ring_never_loses() -> None:
    free = CommCosts(flops_per_s=1e12, p2p_bytes_per_s=1e9, allgather_bytes_per_s=1e9)
    for seq_local in (1, 7, 100, 10_000):
        for p in (2, 3, 8):
            t = predict_times(seq_local=seq_local, cp_size=p, causal=False, costs=free, **SHAPE)
            assert t["p2p"] <= t["all_gather"] * (1 + 1e-12)


def test_memory_budget_forces_p2p() -> None:
    tight = CommCosts(flops_per_s=500e12, p2p_bytes_per_s=400e9, allgather_bytes_per_s=400e9,
                      step_latency_s=20e-6, collective_latency_s=30e-6, memory_budget_bytes=1e3)
    choice = choose_comm(seq_local=16, cp_size=16, causal=True, costs=tight, candidates=("p2p", "all_gather"), **SHAPE)
    assert choice.comm == "p2p" and "memory budget" in choice.reason


def test_single_rank_is_p2p() -> None:
    assert choose_comm(seq_local=16, cp_size=1, causal=False, costs=COSTS, **SHAPE).comm == "p2p"


def test_for_shapes_uses_device_defaults() -> None:
    assert choose_comm_for_shapes((1, 4096, 32, 128), (1, 4096, 8, 128), 8, causal=True, element_size=2,
                                  device_type="cuda") == "p2p"
    assert choose_comm_for_shapes((1, 4, 2, 8), (1, 4, 2, 8), 8, causal=True, element_size=4,
                                  device_type="cpu") == "all_gather"
    with pytest.raises(ValueError, match="batch, seq_local, heads, head_dim"):
        choose_comm_for_shapes((4, 2, 8), (1, 4, 2, 8), 2, causal=True, element_size=4, device_type="cpu")


def test_defaults_are_read_from_the_shipped_profiles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DEFAULT_COSTS and ``comm="auto"`` follow megatron_ring/profiles/*.json: other numbers there, other choices."""
    shipped = dict(DEFAULT_COSTS)
    edited = {}
    for device, (name, dtype, ranks) in DEFAULT_PROFILES.items():
        profile = json.loads((comm_choice.PROFILE_DIR / f"{name}.json").read_text())
        profile.update(p2p_latency_s=0.0, collective_latency_s=0.0, link_efficiency=profile["link_efficiency"] / 2)
        (tmp_path / f"{name}.json").write_text(json.dumps(profile))
        edited[device] = profile_costs(profile, dtype, ranks=ranks)
    monkeypatch.setattr(comm_choice, "PROFILE_DIR", tmp_path)
    comm_choice.default_costs.cache_clear()
    try:
        for device in DEFAULT_PROFILES:
            assert DEFAULT_COSTS[device] == edited[device] != shipped[device]
        # without fixed costs the ring never loses (module Note); with the shipped ones all-gather wins here
        assert choose_comm_for_shapes((1, 4, 2, 8), (1, 4, 2, 8), 8, causal=True, element_size=4,
                                      device_type="cpu") == "p2p"
    finally:
        comm_choice.default_costs.cache_clear()


def test_the_profiles_are_package_data() -> None:
    """A non-editable install ships megatron_ring/profiles/*.json (setup.cfg's package_data)."""
    cfg = configparser.ConfigParser()
    cfg.read(Path(__file__).resolve().parents[2] / "setup.cfg")
    globs = [g.strip() for g in cfg["options.package_data"]["megatron_ring"].split(",")]
    profiles = set(comm_choice.PROFILE_DIR.glob("*.json"))
    assert profiles and profiles <= {p for g in globs for p in comm_choice.PROFILE_DIR.parent.glob(g)}


def test_defaults_equal_the_planners_costs_of_the_same_profiles() -> None:
    from megatron_ring.perf.planner.hardware import HardwareProfile

    for device, (name, dtype, ranks) in DEFAULT_PROFILES.items():
        assert DEFAULT_COSTS[device] == HardwareProfile.load(name).comm_costs(dtype, ranks=ranks)


@pytest.mark.parametrize("field,value,match", [
    ("flops_per_s", 0, "flops_per_s must be > 0"),
    ("p2p_bytes_per_s", -1.0, "p2p_bytes_per_s must be > 0"),
    ("step_latency_s", "x", "step_latency_s must be a number"),
])
def test_costs_validation(field: str, value: object, match: str) -> None:
    kwargs = dict(flops_per_s=1.0, p2p_bytes_per_s=1.0, allgather_bytes_per_s=1.0)
    kwargs[field] = value  # type: ignore[assignment]
    with pytest.raises(ValueError, match=match):
        CommCosts(**kwargs)  # type: ignore[arg-type]


def test_bad_shapes() -> None:
    with pytest.raises(ValueError, match="multiple of heads_kv"):
        choose_comm(seq_local=8, cp_size=2, batch=1, heads_q=6, heads_kv=4, head_dim=8, causal=False,
                    element_size=4, costs=COSTS)
    with pytest.raises(ValueError, match="seq_local must be an int >= 1"):
        choose_comm(seq_local=0, cp_size=2, batch=1, heads_q=4, heads_kv=4, head_dim=8, causal=False,
                    element_size=4, costs=COSTS)


def test_a2a_needs_heads_divisible_by_its_group() -> None:
    t = predict_times(seq_local=1024, cp_size=8, batch=1, heads_q=12, heads_kv=4, head_dim=128, causal=True,
                      element_size=2, costs=COSTS, a2a_size=4)
    assert t["a2a"] == float("inf") and t["a2a+p2p"] < float("inf")
    choice = choose_comm(seq_local=16, cp_size=8, batch=1, heads_q=12, heads_kv=4, head_dim=128, causal=True,
                         element_size=2, costs=COSTS)
    assert choice.comm != "a2a" and choice.times["a2a"] == float("inf")


def test_a2a_wins_when_ring_steps_are_latency_bound() -> None:
    """Short L/P: P step latencies cost more than two all-to-alls; the choice names its competitors."""
    choice = choose_comm(seq_local=64, cp_size=8, causal=True, costs=COSTS, candidates=("p2p", "a2a"), **SHAPE)
    assert choice.comm == "a2a" and "p2p" in choice.reason
    assert choice.times["a2a"] < choice.times["p2p"]


def test_hybrid_wins_across_slow_nodes() -> None:
    """16 ranks on 2 nodes of 8, a slow inter-node link: the flat ring and all-to-all pay it on every
    byte; a2a+p2p keeps the all-to-all in the node and hides the ring behind 8x the compute."""
    nodes = CommCosts(flops_per_s=500e12, p2p_bytes_per_s=400e9, allgather_bytes_per_s=400e9, step_latency_s=20e-6,
                      collective_latency_s=30e-6, inter_node_bytes_per_s=25e9, ranks_per_node=8)
    choice = choose_comm(seq_local=2048, cp_size=16, causal=True, costs=nodes, **SHAPE)
    assert choice.comm == "a2a+p2p", choice.reason
    t = choice.times
    assert t["a2a+p2p"] < min(t["p2p"], t["a2a"], t["all_gather"])


def test_hybrid_is_a_candidate_only_with_its_group_size() -> None:
    choice = choose_comm(seq_local=2048, cp_size=16, causal=True, costs=COSTS, **SHAPE)
    assert choice.comm != "a2a+p2p"
    assert choose_comm_for_shapes((1, 4096, 32, 128), (1, 4096, 8, 128), 8, causal=True, element_size=2,
                                  device_type="cuda", candidates=("a2a+p2p",), a2a_size=4) == "a2a+p2p"


def test_relay_pieces_trade_message_latency_for_buffer_memory() -> None:
    """Note [Pieces per hop]: whole blocks where the extra messages would cost more than PIECES_LATENCY_SHARE of the
    ring's time (short sequences, a high latency), two head groups where they are lost in it; never more than
    MAX_RELAY_PIECES, always a divisor of heads_kv; an override wins, as gcd(override, heads_kv)."""
    h100 = DEFAULT_COSTS["cuda"]
    shape = dict(cp_size=8, batch=1, heads_q=32, heads_kv=8, head_dim=128, causal=True, element_size=2)
    assert [relay_pieces(seq_local=s, **shape, costs=h100) for s in (1024, 4096, 16384, 65536)] == [1, 1, 2, 2]
    assert relay_pieces(seq_local=65536, **{**shape, "heads_kv": 1}, costs=h100) == 1  # MQA: one K/V head
    assert relay_pieces(seq_local=65536, **{**shape, "heads_kv": 3, "heads_q": 33}, costs=h100) == 1  # odd
    assert relay_pieces(seq_local=65536, **{**shape, "cp_size": 1}, costs=h100) == 1  # no ring, no messages
    slow = CommCosts(flops_per_s=h100.flops_per_s, p2p_bytes_per_s=h100.p2p_bytes_per_s,
                     allgather_bytes_per_s=h100.allgather_bytes_per_s, step_latency_s=1e-2)
    assert relay_pieces(seq_local=16384, **shape, costs=slow) == 1  # the same call on a link of 10 ms a message
    for override, pieces in ((1, 1), (2, 2), (4, 4), (3, 1), (16, 8)):
        assert relay_pieces(seq_local=1024, **shape, costs=h100, override=override) == pieces
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"comm_choice\.PIECES must be an int >= 1 or None"):
            relay_pieces(seq_local=1024, **shape, costs=h100, override=bad)


def test_predicted_p2p_time_counts_the_chosen_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """predict_times charges one step latency per message the relay sends: g (P - 1) + 1."""
    shape = dict(seq_local=65536, cp_size=8, batch=1, heads_q=32, heads_kv=8, head_dim=128, causal=True,
                 element_size=2)
    chosen = predict_times(**shape, costs=DEFAULT_COSTS["cuda"])["p2p"]
    monkeypatch.setattr(comm_choice, "PIECES", 1)
    whole = predict_times(**shape, costs=DEFAULT_COSTS["cuda"])["p2p"]
    assert chosen - whole == pytest.approx(7 * DEFAULT_COSTS["cuda"].step_latency_s)
