"""The ``sdpa`` block backend under masks (sdpa_backend.py): key padding, sliding windows in both
conventions, decode's positions, GQA and tiling, forward and backward against float64 on CPU; its
CUDA kernel calls against a CPU stand-in of the ops; and which backend and kernel every (device,
dtype, mask kind) gets.
"""
import pytest
import torch

from megatron_ring.attention import sdpa_backend
from megatron_ring.attention.block import block_backward, block_forward, merge_into, resolve_backend
from megatron_ring.attention.reference import attention_reference, rel_err
from megatron_ring.attention.schedule import schedule_for
from megatron_ring.attention.window import Band, band_limits, positions_visible
from tests.unit.sdpa_cuda_standin import CudaOps

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
TOL = {torch.float32: 1e-6, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _inputs(b: int, sq: int, sk: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int = 0):
    """q ``[b, hq, sq, d]``, k, v ``[b, hkv, sk, d]`` and dout, as views over ``[b, s, h, d]`` memory."""
    gen = torch.Generator().manual_seed(seed)
    shapes = ((sq, hq), (sk, hkv), (sk, hkv), (sq, hq))
    return [torch.randn(b, s, h, d, generator=gen).to(dtype).transpose(1, 2) for s, h in shapes]


def _expected(q, k, v, dout, *, causal, key_mask, window, q_pos, k_pos):
    """float64 out, dq, dk, dv from reference.py: queries and keys placed at their positions in one
    sequence (absent positions are padding keys), the window on positions."""
    n = int(max(q_pos.max(), k_pos.max())) + 1
    leaves = [t.detach().transpose(1, 2).double().requires_grad_() for t in (q, k, v)]
    b, _, hq, d = leaves[0].shape
    hkv = leaves[1].shape[2]
    qf = torch.zeros(b, n, hq, d, dtype=torch.float64).index_copy(1, q_pos, leaves[0])
    kf, vf = (torch.zeros(b, n, hkv, d, dtype=torch.float64).index_copy(1, k_pos, t) for t in leaves[1:])
    present = torch.zeros(b, n, dtype=torch.bool)
    present[:, k_pos] = True if key_mask is None else key_mask
    scale = d ** -0.5
    ref = attention_reference(qf, kf, vf, causal=causal, softmax_scale=scale, key_padding_mask=present,
                              window_size=window)[:, q_pos]
    grads = torch.autograd.grad(ref, leaves, dout.transpose(1, 2).double())
    return ref, [g.transpose(1, 2) for g in grads]


def _run(q, k, v, dout, *, causal, key_mask, visible, backend="sdpa"):
    """The block's out, dq, dk, dv as a one-block ring computes them (merge into an empty result)."""
    scale = q.shape[-1] ** -0.5
    o, l = block_forward(q, k, v, causal=causal, scale=scale, backend=backend, key_mask=key_mask, visible=visible)
    out = torch.zeros(o.shape, dtype=torch.float32)
    lse = torch.full(l.shape, float("-inf"))
    merge_into(out, lse, o, l)
    grads = block_backward(dout, q, k, v, out.to(q.dtype), lse, causal=causal, scale=scale, backend=backend,
                           key_mask=key_mask, visible=visible)
    return out, grads


def _check(got, expected, dtype):
    out, grads = got
    ref, ref_grads = expected
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    errors = [rel_err(out.transpose(1, 2), ref)] + [rel_err(g, e) for g, e in zip(grads, ref_grads)]
    assert max(errors) < TOL[dtype], errors


CASES = {
    # name: (b, sq, sk, causal, key padding, window, q positions, k positions)
    "key padding, causal, left-padded": (2, 24, 24, True, "left", (-1, -1), None, None),
    "key padding, full, a fully padded row": (2, 20, 28, False, "empty row", (-1, -1), None, None),
    "window (left, right), Megatron / flash-attn": (1, 40, 40, False, None, (5, 3), None, None),
    "window (W - 1, 0) + causal, transformers": (2, 40, 40, True, "left", (7, 0), None, None),
    "decode, cache positions in any order": (2, 3, 30, False, "right", (9, 0), "last", "any order"),
}


def _case(name: str, dtype: torch.dtype, heads: tuple[int, int]):
    b, sq, sk, causal, padding, window, q_kind, k_kind = CASES[name]
    q, k, v, dout = _inputs(b, sq, sk, *heads, 16, dtype)
    n = max(sq, sk) if k_kind is None else 3 * sk
    k_pos = torch.arange(sk) if k_kind is None else torch.randperm(n, generator=torch.Generator().manual_seed(1))[:sk]
    q_pos = torch.arange(sq) if q_kind is None else torch.arange(n - sq, n)
    key_mask = None
    if padding is not None:
        key_mask = torch.ones(b, sk, dtype=torch.bool)
        key_mask[0, : sk // 4] = False  # left padding: early queries see no key under causal
        if padding == "empty row":
            key_mask[1] = False
        if padding == "right":
            key_mask[1, -sk // 5:] = False
    visible = None if window == (-1, -1) else positions_visible(q_pos, k_pos, window)
    return (q, k, v, dout), dict(causal=causal, key_mask=key_mask, visible=visible), \
        dict(causal=causal, key_mask=key_mask, window=window, q_pos=q_pos, k_pos=k_pos)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("name", list(CASES))
def test_masked_block_matches_float64(name, dtype, heads):
    tensors, masks, reference = _case(name, dtype, heads)
    _check(_run(*tensors, **masks), _expected(*tensors, **reference), dtype)


def test_band_tile_as_the_ring_passes_it():
    """A banded piece of a block (schedule.py's plans: Band(offset, lo, hi)), causal window."""
    q, k, v, dout = _inputs(1, 32, 48, 4, 2, 16, torch.float32)
    lo, hi = band_limits((20, 0), causal=True)
    band = Band(offset=30, lo=lo, hi=hi)  # query row i is at position 30 + i relative to key 0
    got = _run(q, k, v, dout, causal=False, key_mask=None, visible=band.visible(32, 48, CPU))
    expected = _expected(q, k, v, dout, causal=True, key_mask=None, window=(20, 0), q_pos=torch.arange(30, 62),
                         k_pos=torch.arange(48))
    _check(got, expected, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiles_match_one_call(monkeypatch, dtype):
    """Past BIAS_ELEMENTS the queries run in tiles, each on the keys it reaches (some reach none)."""
    _, masks, _ = _case("decode, cache positions in any order", dtype, (4, 2))
    q, k, v, dout = _inputs(2, 24, 30, 4, 2, 16, dtype)
    q_pos = torch.tensor(list(range(5)) + list(range(60, 79)))  # the first five see no cached key
    k_pos = 30 + torch.randperm(30, generator=torch.Generator().manual_seed(2))
    visible = positions_visible(q_pos, k_pos, (9, 0))
    one = _run(q, k, v, dout, causal=False, key_mask=masks["key_mask"], visible=visible)
    monkeypatch.setattr(sdpa_backend, "BIAS_ELEMENTS", 2 * 2 * 30 * 5)  # 5 queries per tile
    plan = sdpa_backend._plan(q, k, masks["key_mask"], visible)
    assert len(plan) == 5 and plan[0][1] == slice(0, 0)
    tiled = _run(q, k, v, dout, causal=False, key_mask=masks["key_mask"], visible=visible)
    expected = _expected(q, k, v, dout, causal=False, key_mask=masks["key_mask"], window=(9, 0), q_pos=q_pos,
                         k_pos=k_pos)
    _check(tiled, expected, dtype)
    for a, b in zip((one[0], *one[1]), (tiled[0], *tiled[1])):
        assert rel_err(b, a) < TOL[dtype]


def test_bias_is_a_row_for_key_padding():
    """Key padding alone is one [b, 1, 1, k] row (broadcast), stored padded to the kernel's alignment."""
    mask = torch.tensor([[True, False, True]])
    bias = sdpa_backend._bias(mask, None, 1, torch.bfloat16, 16)
    assert bias.shape == (1, 1, 1, 3) and bias.stride() == (16, 16, 16, 1)
    assert bias.tolist() == [[[[0.0, float("-inf"), 0.0]]]]
    visible = torch.tensor([[True, False, True], [False, True, True]])
    assert sdpa_backend._bias(None, visible, 2, torch.float32, 1).shape == (1, 1, 4, 3)


# The CUDA kernel calls, on a CPU stand-in of the ops.

@pytest.fixture
def cuda_ops(monkeypatch):
    ops = CudaOps()
    monkeypatch.setattr(sdpa_backend, "_aten", ops)
    return ops


def _kernel_run(kernel, q, k, v, dout, *, causal, key_mask, visible):
    scale = q.shape[-1] ** -0.5
    o, l = sdpa_backend.sdpa_forward(q, k, v, causal=causal, scale=scale, key_mask=key_mask, visible=visible,
                                     kernel=kernel)
    out = torch.zeros(o.shape, dtype=torch.float32, device=o.device)
    lse = torch.full(l.shape, float("-inf"), device=o.device)
    merge_into(out, lse, o, l)
    grads = sdpa_backend.sdpa_backward(dout, q, k, v, out.to(q.dtype), lse, causal=causal, scale=scale,
                                       key_mask=key_mask, visible=visible, kernel=kernel)
    return out, [g.float() for g in grads]


@pytest.mark.parametrize("kernel", ["cudnn", "efficient"])
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_kernel_calls(cuda_ops, kernel, name):
    tensors, masks, reference = _case(name, torch.bfloat16, (4, 2))
    _check(_kernel_run(kernel, *tensors, **masks), _expected(*tensors, **reference), torch.bfloat16)
    calls = 2 if masks["causal"] and masks["visible"] is None else 1  # causal flag: a call per head slice
    assert cuda_ops.calls == [kernel] * calls + [f"{kernel}_backward"] * calls


@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
@pytest.mark.parametrize("causal", [True, False])
def test_cuda_unmasked_kernel_calls(cuda_ops, kernel, causal):
    q, k, v, dout = _inputs(2, 24, 24, 4, 2, 16, torch.bfloat16)
    expected = _expected(q, k, v, dout, causal=causal, key_mask=None, window=(-1, -1), q_pos=torch.arange(24),
                         k_pos=torch.arange(24))
    _check(_kernel_run(kernel, q, k, v, dout, causal=causal, key_mask=None, visible=None), expected, torch.bfloat16)


def test_cuda_kernel_calls_in_tiles(cuda_ops, monkeypatch):
    tensors, masks, reference = _case("decode, cache positions in any order", torch.bfloat16, (4, 2))
    monkeypatch.setattr(sdpa_backend, "BIAS_ELEMENTS", 2 * 2 * 30)  # one query per tile
    _check(_kernel_run("efficient", *tensors, **masks), _expected(*tensors, **reference), torch.bfloat16)
    assert cuda_ops.calls.count("efficient") == 3


# Which backend and kernel: every (device, dtype, mask kind).

def _masked(kind: str) -> bool:
    """Whether a call of this mask kind hands its blocks a mask (call.py / decode.py: masked=...)."""
    if kind == "packed documents":  # the schedule cuts blocks at document bounds: no mask inside
        return schedule_for(0, 2, 16, (16, 8, 8), causal=True, sharding="zigzag", window=(-1, -1)).windowed
    if kind in ("sliding window (Megatron)", "sliding window (transformers)"):
        window = (3, 2) if kind.endswith("(Megatron)") else (5 - 1, 0)
        return schedule_for(0, 2, 16, None, causal=True, sharding="zigzag", window=window).windowed
    return kind != "none"  # key padding, decode positions


KINDS = ["none", "key padding", "sliding window (Megatron)", "sliding window (transformers)", "decode positions",
         "packed documents"]


@pytest.mark.parametrize("capability", [None, (8, 0), (9, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("kind", KINDS)
def test_backend_and_kernel_choice(monkeypatch, capability, dtype, kind):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    device = CPU if capability is None else CUDA
    masked = _masked(kind)
    assert masked == (kind not in ("none", "packed documents"))
    backend = resolve_backend("auto", device, dtype, 128, masked=masked)
    fused = device.type == "cpu" or dtype in (torch.bfloat16, torch.float16)
    assert backend == ("sdpa" if fused else "math")  # flash-attn is not installed here
    if backend == "sdpa":
        kernel = sdpa_backend.kernel_for(device, masked)
        if device.type == "cpu":
            assert kernel == "cpu_flash"
        elif capability >= (9, 0):
            assert kernel == "cudnn"
        else:
            assert kernel == ("efficient" if masked else "flash")
    assert resolve_backend("math", device, dtype, 128, masked=masked) == "math"
    if masked:
        with pytest.raises(ValueError, match="backend 'flash_attn' cannot take a key_padding_mask"):
            resolve_backend("flash_attn", device, dtype, 128, masked=True)


def test_masked_sdpa_on_cuda_needs_its_dtypes():
    with pytest.raises(ValueError, match=r"backend 'sdpa' cannot take device=cuda, dtype=torch.float32"):
        resolve_backend("sdpa", CUDA, torch.float32, 128, masked=True)
    assert resolve_backend("sdpa", CUDA, torch.bfloat16, 128, masked=True) == "sdpa"
    assert resolve_backend("auto", CUDA, torch.bfloat16, 100, masked=True) == "math"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(CASES))
def test_real_cuda_kernels_match_float64(name):
    """On a GPU: each masked CUDA kernel of this device vs float64 (the stand-in's cases, bf16)."""
    tensors, masks, reference = _case(name, torch.bfloat16, (4, 2))
    moved = [t.cuda() for t in tensors]
    masks = {key: (m.cuda() if isinstance(m, torch.Tensor) else m) for key, m in masks.items()}
    default = sdpa_backend.kernel_for(CUDA, masked=True)
    for kernel in {default, "efficient"}:
        out, grads = _kernel_run(kernel, *moved, **masks)
        _check((out.cpu(), [g.cpu() for g in grads]), _expected(*tensors, **reference), torch.bfloat16)
