"""Bytes one rank sends per attention call (costs/traffic.py): the closed forms, per comm."""
from __future__ import annotations

import pytest

from megatron_ring.attention.comms import COMMS
from megatron_ring.costs.traffic import (
    a2a_bytes, all_gather_bytes, alltoall_bytes, bytes_sent, kv_block_bytes, kv_heads_sent, p2p_bytes,
)

SHAPE = dict(batch=2, seq_local=16, heads_q=8, heads_kv=2, head_dim=4, element_size=2)
KV = 2 * 2 * 16 * 2 * 4  # 2 * b * c * H_kv * d elements


def test_one_kv_block_and_the_heads_an_all_to_all_carries() -> None:
    assert kv_block_bytes(batch=2, seq_local=16, heads_kv=2, head_dim=4, element_size=2) == KV * 2
    assert [kv_heads_sent(h, 4) for h in (1, 2, 4, 8, 6)] == [4, 4, 4, 8, 12]


def test_ring_and_all_gather() -> None:
    kv = dict(batch=2, seq_local=16, heads_kv=2, head_dim=4, element_size=2, cp_size=4)
    assert p2p_bytes(**kv) == all_gather_bytes(**kv) == 3 * KV * 2
    assert p2p_bytes(**kv, backward=True) == 3 * KV * 2 + 4 * KV * 4  # K/V again, fp32 dK/dV P times
    assert all_gather_bytes(**kv, backward=True) == 3 * KV * 2 + 3 * KV * 4
    assert p2p_bytes(**{**kv, "cp_size": 1}, backward=True) == 0


def test_all_to_all_comms() -> None:
    unit = 2 * 16 * 4 * 2  # b * c * d * e
    assert alltoall_bytes(**SHAPE, a2a_size=4) == 3 / 4 * unit * (2 * 8 + 2 * 2)
    assert a2a_bytes(**SHAPE, a2a_size=4, ring_size=1) == 3 / 4 * unit * (2 * 8 + 2 * 4)  # H' = lcm(2, 4)
    assert a2a_bytes(**SHAPE, a2a_size=2, ring_size=2, backward=True) == \
        1 / 2 * unit * (2 * 8 + 2 * 2) + 1 * 2 * unit * 2 + 2 * 2 * unit * 2 * 4 / 2


def test_bytes_sent_dispatches_every_comm() -> None:
    sent = {c: bytes_sent(c, **SHAPE, cp_size=4, a2a_size=2) for c in COMMS}
    assert sent["p2p"] == p2p_bytes(**{k: v for k, v in SHAPE.items() if k != "heads_q"}, cp_size=4)
    assert sent["a2a"] == a2a_bytes(**SHAPE, a2a_size=4, ring_size=1)
    assert sent["a2a+p2p"] == a2a_bytes(**SHAPE, a2a_size=2, ring_size=2)
    with pytest.raises(ValueError, match="comm must be one of"):
        bytes_sent("ring", **SHAPE, cp_size=4)
    with pytest.raises(ValueError, match="a2a_size must divide cp_size"):
        bytes_sent("a2a+p2p", **SHAPE, cp_size=4, a2a_size=3)
