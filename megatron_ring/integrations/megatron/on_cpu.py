"""Megatron-core on CPU processes (gloo): every CUDA-only internal we patch, in one table, behind one version guard.

Note [Megatron-core on CPU]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Megatron-core assumes CUDA in places that change no number. This project runs it on CPU processes
(the tests, the demo, CPU inference and training) in two scopes, both listed here and both behind
:func:`check_megatron_version`:

* **The model's forward / backward** (:data:`PATCHES`): RoPE, the CP RoPE index, the attention
  score buffer, the causal masks, the RNG tracker around attention dropout and the tied-embedding
  all-reduce of ``pp > 1``. :func:`enable_megatron_on_cpu` replaces these Megatron internals with
  device-agnostic equivalents (same numbers, same cost) for the rest of the process;
  :func:`~megatron_ring.integrations.megatron.state.init_megatron` calls it on CPU, importing the
  package never does. It is idempotent and :func:`disable_megatron_on_cpu` puts every original
  back. Process-wide rather than scoped because a Megatron model runs from many places (the
  inference runners, the equivalence checks, Megatron's own schedules, test workers) and
  activation recomputation re-runs the attention inside ``backward()``, outside any forward call
  a scope could wrap; each patch touches only Megatron's own code, which on CPU would fail anyway.
* **Megatron's training stack** (DDP, optimizers, pipeline schedules, gradient clipping,
  checkpointing, the sequence-parallel collectives): dozens of ``device="cuda"`` / ``.cuda()`` /
  ``torch.cuda.synchronize()`` calls and ``param.type() == "torch.cuda.FloatTensor"`` checks.
  Rather than patch each, :func:`cuda_calls_on_cpu` is a scoped ``TorchFunctionMode`` that puts
  every tensor asking for a CUDA device on the CPU, makes ``.cuda()`` the identity and answers a
  CPU tensor's ``type()`` with its CUDA name, with four ``torch.cuda`` functions stood in for
  (:data:`CUDA_STAND_INS`). It stays scoped (entered around the engine's calls into Megatron): it
  changes torch itself for everything running inside it, and it costs a Python call per torch op,
  which the model's forward (inference decode steps included) must not pay. On a GPU it is empty.

The guard: an installed megatron-core outside :data:`CHECKED_RANGE` is refused with a
:class:`MegatronCompatibilityError` naming both, unless ``MEGATRON_RING_UNCHECKED_MEGATRON=1``
opts in (then it patches with a warning). Every patch also checks, before anything is replaced,
that the internal it replaces (and each internal its replacement calls) exists with the
parameters it was written against; a mismatch names the internal, both signatures and the version.
"""
from __future__ import annotations

import importlib
import inspect
import operator
import os
import re
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import lru_cache, reduce
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode

CHECKED_RANGE = ((0, 16), (0, 17))
"""megatron-core versions ``>= 0.16, < 0.17`` (major, minor): the range the patches were checked on
(setup.cfg's ``megatron-core`` requirement says the same; tests/unit/test_megatron_version_guard.py)."""
CHECKED_ON = ("0.16.1",)
"""The megatron-core releases this project's tests ran on with these patches."""
UNCHECKED_ENV = "MEGATRON_RING_UNCHECKED_MEGATRON"
"""Set to ``1`` to patch a megatron-core outside :data:`CHECKED_RANGE` anyway (with a warning)."""


class MegatronCompatibilityError(RuntimeError):
    """The installed megatron-core is not one the CPU patches were checked on, or lacks an internal they replace."""


def checked_range_text() -> str:
    """:data:`CHECKED_RANGE` as a pip requirement specifier, ``">=0.16,<0.17"``."""
    (lo_major, lo_minor), (hi_major, hi_minor) = CHECKED_RANGE
    return f">={lo_major}.{lo_minor},<{hi_major}.{hi_minor}"


def installed_megatron_version() -> str:
    """``megatron.core.__version__`` of the installed megatron-core."""
    import megatron.core

    return str(megatron.core.__version__)


def check_megatron_version(version: str) -> bool:
    """True when ``version`` lies in :data:`CHECKED_RANGE`; otherwise :class:`MegatronCompatibilityError`,
    or, with ``MEGATRON_RING_UNCHECKED_MEGATRON=1``, a warning and False."""
    match = re.match(r"(\d+)\.(\d+)", version)
    low, high = CHECKED_RANGE
    if match and low <= (int(match[1]), int(match[2])) < high:
        return True
    opt_in = os.environ.get(UNCHECKED_ENV, "")
    if opt_in not in ("", "0", "1"):
        raise ValueError(f"environment variable {UNCHECKED_ENV}={opt_in!r}: allowed values are 1 (patch a "
                         f"megatron-core outside {checked_range_text()} anyway) and 0 or unset (refuse)")
    where = (f"megatron-core {version} is installed, but megatron_ring runs Megatron on CPU by replacing "
             f"internals checked on megatron-core {checked_range_text()} (releases {', '.join(CHECKED_ON)}; "
             f"the table is megatron_ring.integrations.megatron.on_cpu.PATCHES)")
    if opt_in != "1":
        raise MegatronCompatibilityError(
            f"{where}. Install a checked version (megatron-core{checked_range_text()}), or set "
            f"{UNCHECKED_ENV}=1 to patch it anyway (each internal is still checked to exist with its parameters).")
    warnings.warn(f"{where}; patching anyway because {UNCHECKED_ENV}=1: numbers are unchecked on this version",
                  stacklevel=2)
    return False


# --- the table ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Patch:
    """One replaced internal: ``module``'s ``attribute`` (dotted inside the module) becomes ``build(original)``."""

    module: str
    attribute: str
    parameters: Optional[tuple[str, ...]]
    """The original's parameter names (checked before patching); None: a value, not a function."""
    why: str
    build: Callable[[Any], Any]
    uses: tuple[tuple[str, str, tuple[str, ...]], ...] = ()
    """Other internals the replacement calls: ``(module, attribute, parameters)``, checked the same way."""
    checked_on: tuple[str, ...] = CHECKED_ON

    @property
    def name(self) -> str:
        """The qualified name, ``megatron.core.utils.GlobalMemoryBuffer.get_tensor``."""
        return f"{self.module}.{self.attribute}"


def _get_emb(self: Any, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    """``RotaryEmbedding.get_emb`` without the move to CUDA: ``[max_seq_len, 1, 1, dim]``."""
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    if not self.rotary_interleaved:
        emb = torch.cat((freqs, freqs), dim=-1)
    else:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    return emb[:, None, None, :]


def _get_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group: Any) -> torch.Tensor:
    """Megatron's zigzag slice of a position table, with the index on ``pos_emb``'s device."""
    if cp_group is None:
        raise ValueError("cp_group must be provided to get positional embedding per CP rank")
    cp_size, cp_rank = cp_group.size(), cp_group.rank()
    idx = torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1], device=pos_emb.device)
    pos_emb = pos_emb.view(*pos_emb.shape[:seq_dim], 2 * cp_size, -1, *pos_emb.shape[seq_dim + 1:])
    pos_emb = pos_emb.index_select(seq_dim, idx)
    return pos_emb.view(*pos_emb.shape[:seq_dim], -1, *pos_emb.shape[seq_dim + 2:])


def _get_tensor(self: Any, tensor_shape: Any, dtype: torch.dtype, name: str,
                mem_alloc_context: Optional[Callable[..., Any]] = None) -> torch.Tensor:
    """``GlobalMemoryBuffer.get_tensor`` allocating on CPU."""
    needed = reduce(operator.mul, tensor_shape, 1)
    buf = self.buffer.get((name, dtype))
    if buf is None or buf.numel() < needed:
        buf = self.buffer[(name, dtype)] = torch.empty(needed, dtype=dtype)
    return buf[:needed].view(*tensor_shape)


@lru_cache(maxsize=8)
def _default_causal_mask(sq: int) -> torch.Tensor:
    """``[sq, sq]`` bool, True above the diagonal (masked), on CPU."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _sliding_window_causal_mask(sq: int, skv: int, window_size: tuple[int, int]) -> torch.Tensor:
    """Megatron's ``get_sliding_window_causal_mask`` on CPU: ``[sq, skv]`` bool, True = masked."""
    keep = torch.ones(sq, skv, dtype=torch.bool).triu(diagonal=skv - sq - window_size[0])
    return ~keep.tril(diagonal=skv - sq + window_size[1])


def _setup_on_own_device(original: Callable[[Any], None]) -> Callable[[Any], None]:
    """``LanguageModule.setup_embeddings_and_output_layer`` with its all-reduce of tied embeddings on the
    weight's own device: the original is told it is outside the embedding group (so it skips its
    ``.cuda()`` and all-reduce), and the all-reduce follows if the real answer was yes."""
    def setup(self: Any) -> None:
        asked: list[bool] = []

        def in_group() -> bool:
            asked.append(type(self)._is_in_embd_group(self))
            return False

        self._is_in_embd_group = in_group
        try:
            original(self)
        finally:
            del self._is_in_embd_group
        if any(asked):
            torch.distributed.all_reduce(self.shared_embedding_or_output_weight().data, group=self.embd_group)
    return setup


def _inference_rng_tracker(original: Any) -> Any:
    """Megatron's inference RNG tracker (its ``fork()`` is a no-op context: no CUDA generator is touched);
    made by Megatron's own ``initialize_rng_tracker``, which also sets ``_CUDA_RNG_STATE_TRACKER_INITIALIZED``."""
    from megatron.core.tensor_parallel import random as tp_random

    tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    return tp_random._CUDA_RNG_STATE_TRACKER


_ROPE = "megatron.core.models.common.embeddings"
_CP_SLICE_WHY = "builds the zigzag index with pin_memory=True and .cuda() (imported by name, so patched where used)"
_CP_SLICE = ("pos_emb", "seq_dim", "cp_group")

PATCHES: tuple[Patch, ...] = (
    Patch(f"{_ROPE}.rotary_pos_embedding", "RotaryEmbedding.get_emb", ("self", "max_seq_len", "offset"),
          "moves the RoPE frequencies to torch.cuda.current_device()", lambda original: _get_emb,
          uses=((f"{_ROPE}.rotary_pos_embedding", "RotaryEmbedding.get_freqs_non_repeated",
                 ("self", "max_seq_len", "offset")),)),
    Patch(f"{_ROPE}.rope_utils", "get_pos_emb_on_this_cp_rank", _CP_SLICE, _CP_SLICE_WHY,
          lambda original: _get_pos_emb_on_this_cp_rank),
    Patch(f"{_ROPE}.rotary_pos_embedding", "get_pos_emb_on_this_cp_rank", _CP_SLICE, _CP_SLICE_WHY,
          lambda original: _get_pos_emb_on_this_cp_rank),
    Patch(f"{_ROPE}.yarn_rotary_pos_embedding", "get_pos_emb_on_this_cp_rank", _CP_SLICE, _CP_SLICE_WHY,
          lambda original: _get_pos_emb_on_this_cp_rank),
    Patch("megatron.core.utils", "GlobalMemoryBuffer.get_tensor",
          ("self", "tensor_shape", "dtype", "name", "mem_alloc_context"),
          "allocates DotProductAttention's score buffer on torch.cuda.current_device()", lambda original: _get_tensor),
    Patch("megatron.core.fusions.fused_softmax", "get_default_causal_mask", ("sq",),
          "builds the causal mask of the torch softmax path on 'cuda'", lambda original: _default_causal_mask),
    Patch("megatron.core.fusions.fused_softmax", "get_sliding_window_causal_mask", ("sq", "skv", "window_size"),
          "builds the sliding-window mask of the torch softmax path on 'cuda'",
          lambda original: _sliding_window_causal_mask),
    Patch("megatron.core.models.common.language_module.language_module",
          "LanguageModule.setup_embeddings_and_output_layer", ("self",),
          "moves tied embeddings to CUDA for the all-reduce that copies them to the last stage (pp > 1)",
          _setup_on_own_device,
          uses=(("megatron.core.models.common.language_module.language_module", "LanguageModule._is_in_embd_group",
                 ("self",)),
                ("megatron.core.models.common.language_module.language_module",
                 "LanguageModule.shared_embedding_or_output_weight", ("self",)))),
    Patch("megatron.core.tensor_parallel.random", "_CUDA_RNG_STATE_TRACKER", None,
          "the training tracker's fork() around attention dropout swaps CUDA generator states",
          _inference_rng_tracker,
          uses=(("megatron.core.tensor_parallel.random", "initialize_rng_tracker",
                 ("use_te_rng_tracker", "inference_rng_tracker", "use_cudagraphable_rng", "force_reset")),)),
    Patch("megatron.core.tensor_parallel.random", "_CUDA_RNG_STATE_TRACKER_INITIALIZED", None,
          "set with the tracker above (restored with it)", lambda original: True),
)
"""Megatron internals replaced for the process by :func:`enable_megatron_on_cpu` (Note [Megatron-core on CPU])."""

CUDA_STAND_INS: tuple[Patch, ...] = (
    Patch("torch.cuda", "current_device", (), "Megatron's allocations ask it for their device",
          lambda original: lambda: "cpu"),
    Patch("torch.cuda", "synchronize", ("device",), "the schedules and the optimizer synchronize",
          lambda original: lambda *args, **kwargs: None),
    Patch("torch.cuda", "empty_cache", (), "the checkpoint and optimizer paths free the CUDA cache",
          lambda original: lambda: None),
    # restoring the CUDA state is a lazy call that never runs without CUDA
    Patch("torch.cuda.random", "get_rng_state", ("device",),
          "activation recomputation saves the CUDA generator's state next to the CPU one",
          lambda original: lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)),
)
"""``torch.cuda`` functions stood in for inside :func:`cuda_calls_on_cpu` only, for Megatron's training stack."""


# --- checking and swapping ---------------------------------------------------------------------------


def _resolve(module: str, attribute: str, version: str) -> tuple[Any, str, Any]:
    """``(owner, last name, current value)`` of ``module.attribute``; MegatronCompatibilityError if missing."""
    try:
        owner = importlib.import_module(module)
        *path, last = attribute.split(".")
        for part in path:
            owner = getattr(owner, part)
        return owner, last, getattr(owner, last)
    except (ImportError, AttributeError) as exc:
        raise MegatronCompatibilityError(
            f"megatron-core {version}: {module}.{attribute} is missing ({exc}); megatron_ring's CPU patches "
            f"(megatron_ring.integrations.megatron.on_cpu) were checked on megatron-core {checked_range_text()}"
        ) from exc


def _check_parameters(name: str, value: Any, expected: Optional[tuple[str, ...]], version: str) -> None:
    if expected is None:
        return
    try:
        found = tuple(inspect.signature(value).parameters)
    except (TypeError, ValueError) as exc:
        raise MegatronCompatibilityError(f"megatron-core {version}: {name} is not a function ({exc})") from exc
    if found != expected:
        raise MegatronCompatibilityError(
            f"megatron-core {version}: {name} takes ({', '.join(found)}), but megatron_ring's CPU patch was "
            f"written for ({', '.join(expected)}) on megatron-core {checked_range_text()}; it was not patched")


def check_patches(patches: tuple[Patch, ...], version: str) -> list[tuple[Any, str, Any]]:
    """Every patch's target ``(owner, name, original)``, after checking that it and each internal its
    replacement uses exist with the expected parameters (MegatronCompatibilityError otherwise)."""
    targets = []
    for patch in patches:
        for module, attribute, parameters in patch.uses:
            _check_parameters(f"{module}.{attribute}", _resolve(module, attribute, version)[2], parameters, version)
        target = _resolve(patch.module, patch.attribute, version)
        _check_parameters(patch.name, target[2], patch.parameters, version)
        targets.append(target)
    return targets


_ORIGINALS: list[tuple[Any, str, Any]] = []
"""``(owner, name, original)`` of every applied :data:`PATCHES` entry; empty when not applied."""


def megatron_on_cpu_enabled() -> bool:
    """Whether :data:`PATCHES` are applied in this process."""
    return bool(_ORIGINALS)


def enable_megatron_on_cpu() -> None:
    """Replace the Megatron internals of :data:`PATCHES` for this process (idempotent), after the version
    guard and the check of every internal; nothing is replaced if any check fails."""
    if _ORIGINALS:
        return
    version = installed_megatron_version()
    check_megatron_version(version)
    targets = check_patches(PATCHES, version)
    for patch, (owner, name, original) in zip(PATCHES, targets):
        setattr(owner, name, patch.build(original))
        _ORIGINALS.append((owner, name, original))


def disable_megatron_on_cpu() -> None:
    """Put back every original :func:`enable_megatron_on_cpu` replaced (no-op when not applied)."""
    while _ORIGINALS:
        owner, name, original = _ORIGINALS.pop()
        setattr(owner, name, original)


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


_STAND_IN_TARGETS: list[tuple[Any, str]] = []
"""``(owner, name)`` of every :data:`CUDA_STAND_INS` entry, once the version guard and their check passed
(the context is entered every training step: it checks once)."""


@contextmanager
def _cuda_calls_on_cpu() -> Iterator[None]:
    if not _STAND_IN_TARGETS:
        version = installed_megatron_version()
        check_megatron_version(version)
        _STAND_IN_TARGETS.extend((owner, name) for owner, name, _ in check_patches(CUDA_STAND_INS, version))
    saved = [getattr(owner, name) for owner, name in _STAND_IN_TARGETS]
    for (owner, name), patch, original in zip(_STAND_IN_TARGETS, CUDA_STAND_INS, saved):
        setattr(owner, name, patch.build(original))
    try:
        with _CudaOnCpuMode():
            yield
    finally:
        for (owner, name), original in zip(_STAND_IN_TARGETS, saved):
            setattr(owner, name, original)


def cuda_calls_on_cpu() -> ContextManager[None]:
    """Context in which Megatron-core's training stack runs on the CPU (Note [Megatron-core on CPU]);
    empty when CUDA is available."""
    return nullcontext() if torch.cuda.is_available() else _cuda_calls_on_cpu()
