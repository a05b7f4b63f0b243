"""K/V travel in the caller's dtype; dK/dV travel in fp32 (Note [Overlap and double buffering]).

The bytes are read off the tensors handed to ``batch_isend_irecv`` and ``reduce``, not from the
ring's own counters, so a transport that upcast K/V (2x the bytes of bf16) or sent bf16 gradients
fails here. dK/dV stay fp32 on the wire: the relay's accumulator collects P contributions hop by
hop, and bf16 sums would round at every hop (docs/numerics.md gives the backward errors this keeps).
"""
import pytest
import torch

from tests.gloo import wire_workers

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("size", [2, 3])
def test_relay_ring_sends_kv_in_its_dtype_and_gradients_in_fp32(gloo_pool, size, dtype):
    for rank in gloo_pool(size).run(wire_workers.bytes_on_the_wire, "p2p", dtype):
        kv = rank["kv_block_bytes"]
        grads = kv * 4 // torch.tensor([], dtype=dtype).element_size()  # dK/dV of the block in fp32
        assert rank["forward"] == {"bytes": (size - 1) * kv, "dtypes": [str(dtype)]}
        dtypes = sorted({str(dtype), "torch.float32"})
        assert rank["backward"] == {"bytes": (size - 1) * kv + size * grads, "dtypes": dtypes}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gather_sends_kv_in_its_dtype_and_reduces_gradients_in_fp32(gloo_pool, dtype):
    size = 3
    for rank in gloo_pool(size).run(wire_workers.bytes_on_the_wire, "all_gather", dtype):
        kv = rank["kv_block_bytes"]
        grads = kv * 4 // torch.tensor([], dtype=dtype).element_size()
        assert rank["forward"] == {"bytes": (size - 1) * kv, "dtypes": [str(dtype)]}
        assert rank["backward"]["bytes"] == (size - 1) * kv + size * grads
        assert rank["backward"]["dtypes"] == sorted({str(dtype), "torch.float32"})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_direct_transfers_send_kv_rows_in_their_dtype(gloo_pool, dtype):
    for rank in gloo_pool(3).run(wire_workers.bytes_on_the_wire, "p2p", dtype, (8, 0)):
        assert rank["forward"]["dtypes"] in ([], [str(dtype)])
        assert set(rank["backward"]["dtypes"]) <= {str(dtype), "torch.float32"}
        assert rank["forward"]["bytes"] < 2 * rank["kv_block_bytes"]  # only the rows a window reads
