"""The flash-attn block backend: when it is chosen, the errors when it cannot be, and its numerics.

Without a GPU the adapter runs against a CPU stand-in of the package's interface
(tests/unit/flash_attn_standin.py) for two releases' signatures; with a CUDA GPU and flash-attn
installed, the last tests run the real kernels against float64.
"""
import math
import sys
import types

import pytest
import torch

from megatron_ring.attention import flash_attn_backend
from megatron_ring.attention.block import block_backward, block_forward, resolve_backend
from megatron_ring.attention.block import merge_into
from megatron_ring.attention.reference import attention_reference, rel_err
from tests.unit import flash_attn_standin

CUDA = torch.device("cuda")
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}


@pytest.fixture
def fresh_load(monkeypatch):
    """Forget the cached flash-attn import before and after the test."""
    flash_attn_backend._load.cache_clear()
    yield monkeypatch
    flash_attn_backend._load.cache_clear()


@pytest.fixture(params=["2.7.4.post1", "2.6.3"])
def standin(request, fresh_load):
    """The stand-in installed as ``flash_attn`` (the adapter is exercised on CPU tensors)."""
    for name, module in flash_attn_standin.modules(request.param).items():
        fresh_load.setitem(sys.modules, name, module)
    return request.param


def _bhsd(b: int, s: int, h: int, d: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A ``[b, h, s, d]`` view over ``[b, s, h, d]`` memory, as the ring hands blocks to the kernel."""
    return torch.randn(b, s, h, d, generator=gen).to(dtype).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)])
def test_block_matches_float64(standin, dtype, causal, heads):
    gen = torch.Generator().manual_seed(0)
    hq, hkv = heads
    q, k, v, do = (_bhsd(2, 48, h, 16, dtype, gen) for h in (hq, hkv, hkv, hq))
    scale = 1 / math.sqrt(16)
    out, lse = block_forward(q, k, v, causal=causal, scale=scale, backend="flash_attn")
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (2, hq, 48)
    dq, dk, dv = block_backward(do, q, k, v, out, lse, causal=causal, scale=scale, backend="flash_attn")
    assert dk.shape == k.shape and dq.dtype == torch.float32
    ref_in = [t.transpose(1, 2).double().requires_grad_() for t in (q, k, v)]
    ref = attention_reference(*ref_in, causal=causal)
    ref.backward(do.transpose(1, 2).double())
    assert rel_err(out.transpose(1, 2), ref) < TOL[dtype]
    for got, leaf in zip((dq, dk, dv), ref_in):
        assert rel_err(got.transpose(1, 2), leaf.grad) < TOL[dtype]


def test_backward_uses_the_merged_lse(standin):
    """Queries of the second half over a past block and the diagonal block, merged as the ring does:
    each block's backward with the *merged* out/lse sums to the exact gradients."""
    gen = torch.Generator().manual_seed(1)
    half, dtype, scale = 32, torch.bfloat16, 1 / math.sqrt(16)
    q_all, k, v = (_bhsd(1, 2 * half, h, 16, dtype, gen) for h in (4, 2, 2))
    q, do = q_all[:, :, half:], _bhsd(1, half, 4, 16, dtype, gen)
    blocks = [(slice(0, half), False), (slice(half, 2 * half), True)]
    out = torch.zeros(1, 4, half, 16)
    lse = torch.full((1, 4, half), float("-inf"))
    for keys, causal in blocks:
        o, l = block_forward(q, k[:, :, keys], v[:, :, keys], causal=causal, scale=scale, backend="flash_attn")
        merge_into(out, lse, o, l)
    dq = torch.zeros(1, 4, half, 16)
    dk, dv = torch.zeros(1, 2, 2 * half, 16), torch.zeros(1, 2, 2 * half, 16)
    for keys, causal in blocks:
        dq_b, dk_b, dv_b = block_backward(do, q, k[:, :, keys], v[:, :, keys], out.to(dtype), lse, causal=causal,
                                          scale=scale, backend="flash_attn")
        dq += dq_b
        dk[:, :, keys] += dk_b
        dv[:, :, keys] += dv_b
    ref_in = [t.transpose(1, 2).double().requires_grad_() for t in (q_all, k, v)]
    ref = attention_reference(*ref_in, causal=True)[:, half:]
    ref.backward(do.transpose(1, 2).double())
    assert rel_err(out.transpose(1, 2), ref) < 1e-2
    assert rel_err(dq.transpose(1, 2), ref_in[0].grad[:, half:]) < 2e-2
    assert rel_err(dk.transpose(1, 2), ref_in[1].grad) < 2e-2
    assert rel_err(dv.transpose(1, 2), ref_in[2].grad) < 2e-2


def test_standin_rejects_what_the_kernel_rejects(standin):
    from flash_attn.flash_attn_interface import flash_attn_func

    q = torch.randn(1, 8, 2, 16)
    with pytest.raises(RuntimeError, match="fp16/bf16"):
        flash_attn_func(q, q, q)
    with pytest.raises(RuntimeError, match="unit stride"):
        flash_attn_func(*(q.bfloat16().transpose(-1, -2),) * 3)


def test_auto_prefers_flash_attn_before_hopper(standin, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert resolve_backend("auto", CUDA, torch.bfloat16, 128) == "flash_attn"
    assert resolve_backend("auto", CUDA, torch.bfloat16, 100) == "math"
    assert resolve_backend("auto", CUDA, torch.float32, 128) == "math"
    assert resolve_backend("auto", torch.device("cpu"), torch.bfloat16, 128) == "sdpa"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert resolve_backend("auto", CUDA, torch.bfloat16, 128) == "sdpa"
    assert resolve_backend("flash_attn", CUDA, torch.bfloat16, 128) == "flash_attn"


def test_forcing_flash_attn_names_what_is_missing(standin, monkeypatch):
    with pytest.raises(ValueError, match=r"backend 'flash_attn' cannot take device=cpu.*CUDA only"):
        resolve_backend("flash_attn", torch.device("cpu"), torch.bfloat16, 64)
    with pytest.raises(ValueError, match="dtype=torch.float32.*float16/bfloat16"):
        resolve_backend("flash_attn", CUDA, torch.float32, 64)
    with pytest.raises(ValueError, match="head_dim=100.*multiple of 8"):
        resolve_backend("flash_attn", CUDA, torch.bfloat16, 100)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    with pytest.raises(ValueError, match=r"sm_8x or sm_90 GPU, got Tesla T4 \(sm_75\)"):
        resolve_backend("flash_attn", CUDA, torch.bfloat16, 64)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "B200")
    with pytest.raises(ValueError, match=r"got B200 \(sm_100\)"):
        resolve_backend("flash_attn", CUDA, torch.bfloat16, 64)


def test_old_or_missing_package(fresh_load):
    for name, module in flash_attn_standin.modules("2.5.9").items():
        fresh_load.setitem(sys.modules, name, module)
    assert flash_attn_backend.flash_attn_problem(CUDA, torch.bfloat16, 64) == "flash-attn 2.5.9 is not a 2.x release from 2.6 on"
    flash_attn_backend._load.cache_clear()
    fresh_load.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    fresh_load.delitem(sys.modules, "flash_attn.flash_attn_interface")
    assert "cannot be imported" in flash_attn_backend.flash_attn_problem(CUDA, torch.bfloat16, 64)
    flash_attn_backend._load.cache_clear()
    fresh_load.setitem(sys.modules, "flash_attn", None)
    assert "not installed (pip install flash-attn)" in flash_attn_backend.flash_attn_problem(CUDA, torch.bfloat16, 64)
    with pytest.raises(ValueError, match="backend 'flash_attn' cannot take"):
        resolve_backend("flash_attn", CUDA, torch.bfloat16, 64)


def _real_flash_attn() -> bool:
    flash_attn_backend._load.cache_clear()
    return torch.cuda.is_available() and flash_attn_backend.flash_attn_problem(CUDA, torch.bfloat16, 64) is None


@pytest.mark.skipif(not _real_flash_attn(), reason="needs a CUDA GPU (sm_8x/sm_90) with flash-attn 2.x >= 2.6 installed")
@pytest.mark.parametrize("causal", [False, True])
def test_real_flash_attn_ring_matches_float64(causal):
    from megatron_ring import ring_attention

    gen = torch.Generator().manual_seed(2)
    q, k, v, do = (torch.randn(2, 512, h, 64, generator=gen).to(CUDA, torch.bfloat16) for h in (8, 2, 2, 8))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*leaves, causal=causal, backend="flash_attn")
    out.backward(do)
    ref_in = [t.double().cpu().requires_grad_() for t in (q, k, v)]
    ref = attention_reference(*ref_in, causal=causal)
    ref.backward(do.double().cpu())
    assert rel_err(out.cpu(), ref) < 2e-2
    for leaf, ref_leaf in zip(leaves, ref_in):
        assert rel_err(leaf.grad.cpu(), ref_leaf.grad) < 2e-2
