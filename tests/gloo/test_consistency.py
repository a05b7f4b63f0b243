"""Bad distributed input: arguments that differ between ranks, a rank outside the group, a rank
whose input is rejected, zero sizes. Every rank raises the same clear error; none hangs or aborts
(Note [Cross-rank handshake])."""
import pytest

from tests.gloo import workers

TIMEOUT_S = 60
RING_NAMES = dict(seq="seq_local", masked="key_padding_mask", requires_grad="gradients")
DECODE_NAMES = dict(masked="key_padding_mask")


def _shown(field, value):
    """How the error message shows ``value`` of ``field``."""
    if field == "masked":
        return "a mask" if value else "None"
    if field == "requires_grad":
        return "needed" if value else "not needed"
    if field in ("sharding", "comm"):
        return repr(value)
    if field == "softmax_scale" and value is None:
        return repr(1 / 8 ** 0.5)
    return str(value)


def _expected(name, field, defaults, changes, size):
    same, odd = _shown(field, defaults[field]), _shown(field, changes[field])
    if size == 2:
        return f"{name} differs across the CP group: rank [0] has {same}, rank [1] has {odd}"
    return f"{name} differs across the CP group: ranks [0, 2] have {same}, rank [1] has {odd}"


def _assert_all_raise(outcomes, text):
    for rank, (kind, message) in enumerate(outcomes):
        assert kind == "ValueError", f"rank {rank}: {kind} {message}"
        assert text in message, f"rank {rank}: {message!r} lacks {text!r}"


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("comm", ["p2p", "all_gather", "auto"])
@pytest.mark.parametrize("field", list(workers.RING_CHANGES))
def test_ring_arguments_that_differ_raise_on_every_rank(gloo_pool, size, comm, field):
    if field == "comm" and comm == "all_gather":
        pytest.skip("the changed comm is all_gather itself")
    outcomes = gloo_pool(size).run(workers.mismatched_call, "ring", field, [1], comm, timeout_s=TIMEOUT_S)
    defaults = dict(workers.RING_DEFAULTS, comm=comm)
    _assert_all_raise(outcomes, _expected(RING_NAMES.get(field, field), field, defaults, workers.RING_CHANGES, size))
    assert all("ring_attention: " in message for _, message in outcomes)


@pytest.mark.parametrize("size", [2, 3])
def test_relay_pieces_set_on_one_rank_raise_on_every_rank(gloo_pool, size):
    """``comm_choice.PIECES`` is a process's setting: set on one rank only, the relays would send different numbers
    of messages and wait on each other. The handshake compares the pieces each rank would use, so every rank
    raises, naming them (the cost model keeps whole blocks at this shape; rank 1 asked for 2)."""
    outcomes = gloo_pool(size).run(workers.pieces_set_on_one_rank, 1, 2, timeout_s=TIMEOUT_S)
    pieces = "relay_pieces"
    _assert_all_raise(outcomes, _expected(pieces, pieces, {pieces: 1}, {pieces: 2}, size))


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("field", list(workers.DECODE_CHANGES))
def test_decode_arguments_that_differ_raise_on_every_rank(gloo_pool, size, field):
    outcomes = gloo_pool(size).run(workers.mismatched_call, "decode", field, [1], timeout_s=TIMEOUT_S)
    expected = _expected(DECODE_NAMES.get(field, field), field, workers.DECODE_DEFAULTS, workers.DECODE_CHANGES, size)
    _assert_all_raise(outcomes, expected)
    assert all("decode_attention: " in message for _, message in outcomes)


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("comm", ["p2p", "all_gather"])
def test_consistent_calls_are_unchanged_by_the_check(gloo_pool, size, comm):
    assert all(gloo_pool(size).run(workers.consistent_calls_with_and_without_check, comm, timeout_s=TIMEOUT_S))


@pytest.mark.parametrize("entry", ["ring", "decode"])
@pytest.mark.parametrize("size,bad_rank", [(2, 0), (3, 1)])
def test_input_rejected_on_one_rank_raises_on_every_rank(gloo_pool, entry, size, bad_rank):
    outcomes = gloo_pool(size).run(workers.rejected_on_one_rank, entry, bad_rank, timeout_s=TIMEOUT_S)
    for rank, (kind, message) in enumerate(outcomes):
        if rank == bad_rank:
            assert kind == "TypeError" and "q.dtype is torch.int32" in message
        else:
            assert kind == "ValueError" and f"the inputs were rejected on rank [{bad_rank}]" in message


@pytest.mark.parametrize("entry", ["ring", "decode"])
def test_a_rank_outside_the_group_gets_a_value_error(gloo_pool, entry):
    outcomes = gloo_pool(3).run(workers.call_from_outside_the_group, entry, timeout_s=TIMEOUT_S)
    assert [kind for kind, _ in outcomes] == ["ok", "ok", "ValueError"]
    assert "this process (global rank 2) is not a member of the given group" in outcomes[2][1]


ZERO_ERRORS = {
    "seq": "q has seq_local = 0; ring_attention needs at least one token per rank (seq_local >= 1)",
    "heads": "q has heads_q = 0; heads_q must be >= 1",
    "heads_kv": "k has heads_kv = 0; heads_kv must be >= 1",
    "head_dim": "q has head_dim = 0; head_dim must be >= 1",
}


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("backend", ["math", "sdpa", "auto"])
@pytest.mark.parametrize("field", ["batch", "seq", "heads", "heads_kv", "head_dim"])
def test_ring_zero_sizes_on_every_rank(gloo_pool, size, backend, field):
    outcomes = gloo_pool(size).run(workers.zero_sized, "ring", field, backend, timeout_s=TIMEOUT_S)
    for outcome in outcomes:
        if field == "batch":  # an empty result, empty gradients
            assert outcome == ("ok", (0, 4, 4, 8), (0, 4, 4, 8), (0, 4, 2, 8))
        else:
            assert outcome == ("ValueError", ZERO_ERRORS[field])


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("backend", ["math", "sdpa", "auto"])
@pytest.mark.parametrize("field", ["batch", "seq", "heads", "heads_kv", "head_dim", "cache"])
def test_decode_zero_sizes_on_every_rank(gloo_pool, size, backend, field):
    outcomes = gloo_pool(size).run(workers.zero_sized, "decode", field, backend, timeout_s=TIMEOUT_S)
    for outcome in outcomes:
        if field == "batch":
            assert outcome == ("ok", (0, 1, 4, 8), 0.0, size)
        elif field == "cache":  # no key anywhere: the zero output of a query that sees no key
            assert outcome == ("ok", (2, 1, 4, 8), 0.0, size)
        elif field == "seq":
            assert outcome == ("ValueError", "q has q_len = 0; decode_attention needs at least one query token "
                                             "(q_len >= 1)")
        else:
            assert outcome == ("ValueError", ZERO_ERRORS[field])


@pytest.mark.parametrize("entry", ["ring", "decode"])
def test_zero_length_on_one_rank_raises_on_every_rank(gloo_pool, entry):
    outcomes = gloo_pool(3).run(workers.zero_sized, entry, "seq", "sdpa", [2], timeout_s=TIMEOUT_S)
    assert outcomes[2][0] == "ValueError" and "= 0;" in outcomes[2][1]
    for kind, message in outcomes[:2]:
        assert kind == "ValueError" and "the inputs were rejected on rank [2]" in message


def test_empty_batch_on_one_rank_is_a_mismatch(gloo_pool):
    outcomes = gloo_pool(2).run(workers.zero_sized, "ring", "batch", "sdpa", [1], timeout_s=TIMEOUT_S)
    _assert_all_raise(outcomes, "batch differs across the CP group: rank [0] has 2, rank [1] has 0")


def test_ring_and_decode_on_different_ranks_raise_on_every_rank(gloo_pool):
    outcomes = gloo_pool(3).run(workers.different_entry_points, timeout_s=TIMEOUT_S)
    _assert_all_raise(outcomes, "entry point differs across the CP group: rank [0] has ring_attention, "
                                "ranks [1, 2] have decode_attention")
