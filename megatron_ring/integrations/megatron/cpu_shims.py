"""The CPU path of megatron-core: run a GPT forward/backward on CPU processes (gloo).

Megatron-core assumes CUDA in a few places that a GPT forward/backward touches:

* ``RotaryEmbedding.get_emb`` moves the RoPE frequencies to ``torch.cuda.current_device()``;
* ``get_pos_emb_on_this_cp_rank`` builds its index with ``pin_memory=True`` and ``.cuda()``;
* ``GlobalMemoryBuffer.get_tensor`` (DotProductAttention's score buffer) allocates on CUDA;
* ``get_default_causal_mask`` and ``get_sliding_window_causal_mask`` (the torch softmax path)
  build their masks on ``"cuda"``;
* the CUDA RNG tracker (``get_cuda_rng_tracker().fork()`` around attention dropout) needs CUDA
  generator states;
* ``LanguageModule.setup_embeddings_and_output_layer`` moves tied embeddings to CUDA for the
  all-reduce that gives the last pipeline stage the first stage's copy (tied embeddings, pp > 1).

:func:`apply_cpu_shims` replaces exactly these with device-agnostic equivalents (same numbers).
It is applied by :func:`megatron_ring.integrations.megatron.state.init_megatron` on CPU only
(the demo, CPU inference and training, tests); importing :mod:`megatron_ring` or its Megatron
integration never patches anything.
"""
from __future__ import annotations

import operator
from functools import lru_cache, reduce
from typing import Any, Callable, Optional

import torch

_APPLIED = False


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


def apply_cpu_shims() -> None:
    """Patch megatron-core's CUDA-only calls listed in the module docstring (idempotent)."""
    global _APPLIED
    if _APPLIED:
        return
    from megatron.core import utils as mcore_utils
    from megatron.core.fusions import fused_softmax
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding
    from megatron.core.tensor_parallel import random as tp_random

    rotary_pos_embedding.RotaryEmbedding.get_emb = _get_emb
    for module in (rope_utils, rotary_pos_embedding, yarn_rotary_pos_embedding):
        module.get_pos_emb_on_this_cp_rank = _get_pos_emb_on_this_cp_rank
    mcore_utils.GlobalMemoryBuffer.get_tensor = _get_tensor
    fused_softmax.get_default_causal_mask = _default_causal_mask
    fused_softmax.get_sliding_window_causal_mask = _sliding_window_causal_mask
    LanguageModule.setup_embeddings_and_output_layer = _setup_on_own_device(
        LanguageModule.setup_embeddings_and_output_layer)
    # The inference tracker's fork() is a no-op context: no CUDA generator is touched.
    tp_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    _APPLIED = True
