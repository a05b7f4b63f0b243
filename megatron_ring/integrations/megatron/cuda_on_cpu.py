"""Megatron-core's training stack (DDP, distributed optimizer, schedules, checkpoints) on CPU processes.

Note [Megatron's CUDA calls on CPU]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Megatron-core's ``DistributedDataParallel``, its optimizers, its pipeline schedules and its
gradient clipping are written for CUDA only: they allocate with ``device="cuda"`` or
``device=torch.cuda.current_device()``, move tensors with ``.cuda()``, call
``torch.cuda.synchronize()`` and accept a parameter only if ``param.type()`` is
``"torch.cuda.FloatTensor"`` (or the Half/BFloat16 names). None of it depends on the device
otherwise: the buffers, bucket reductions, main-parameter shards and 1F1B schedule are plain torch.

:func:`cuda_calls_on_cpu` runs such calls on a CPU-only process (the tests, this project's CPU
runs): a ``TorchFunctionMode`` puts every tensor that asks for a CUDA device on the CPU, makes
``.cuda()`` return the tensor itself and reports a CPU tensor's ``type()`` under its CUDA name;
``torch.cuda.current_device`` answers ``"cpu"``, ``synchronize`` / ``empty_cache`` do nothing and
the CUDA generator's state (saved by activation recomputation) is an empty tensor.
It changes no number: every op runs as written, on the CPU. The engine enters it around its calls
into Megatron-core (construction, forward/backward, optimizer step, checkpointing) and only when
CUDA is absent; on a GPU the context is empty and Megatron runs untouched. Outside it nothing is
patched.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode

_CUDA_TYPE_NAMES = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.HalfTensor": "torch.cuda.HalfTensor",
                    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor", "torch.DoubleTensor": "torch.cuda.DoubleTensor",
                    "torch.LongTensor": "torch.cuda.LongTensor", "torch.IntTensor": "torch.cuda.IntTensor"}


def _is_cuda(device: Any) -> bool:
    """Whether a ``device=`` argument names CUDA (``"cuda"``, ``"cuda:0"``, a CUDA device, an index)."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaOnCpuMode(TorchFunctionMode):
    """Rewrites CUDA device requests to the CPU; ``Tensor.cuda`` is the identity; ``Tensor.type()``
    of a CPU tensor answers its CUDA name."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: Optional[dict[str, Any]] = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return _CUDA_TYPE_NAMES.get(name, name)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


_CUDA_FUNCTIONS: list[tuple[Any, str, Callable[..., Any]]] = [
    (torch.cuda, "current_device", lambda: "cpu"),
    (torch.cuda, "synchronize", lambda *args, **kwargs: None),
    (torch.cuda, "empty_cache", lambda: None),
    # activation recomputation saves the CUDA generator's state next to the CPU one (restoring it is
    # a lazy call that never runs without CUDA): an empty state stands in
    (torch.cuda.random, "get_rng_state", lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)),
]


@contextmanager
def _cuda_calls_on_cpu() -> Iterator[None]:
    saved = [(module, name, getattr(module, name)) for module, name, _ in _CUDA_FUNCTIONS]
    for module, name, replacement in _CUDA_FUNCTIONS:
        setattr(module, name, replacement)
    try:
        with _CudaOnCpuMode():
            yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def cuda_calls_on_cpu() -> ContextManager[None]:
    """Context in which Megatron-core's CUDA-only calls run on the CPU (Note [Megatron's CUDA calls
    on CPU]); empty when CUDA is available."""
    return nullcontext() if torch.cuda.is_available() else _cuda_calls_on_cpu()
