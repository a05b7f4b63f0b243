"""The ranks' side of ``megatron-ring bench train-memory``: one training step of a Megatron GPT and its peak memory.

Every rank of a gloo pool of ``cp`` processes (tp = pp = dp = 1) runs :func:`train_step_peak`: it
builds the model of the config with ``parallel.cp = cp``, an AdamW optimizer whose states already
exist (as from the second step of a run on), and runs forward, backward, the gradient all-reduce
over CP (a sum, Note [The loss of a context-parallel rank] in training/global_loss.py) and the optimizer
step on its zigzag share of one synthetic sequence. The bytes the whole trial adds to the process
are measured by :func:`~megatron_ring.perf.bench.harness.measure_peak` (Note [Peak memory on CPU]);
the model and optimizer are built inside the measured window, so weights, gradients and optimizer
states count (Note [What the cap counts] in perf/bench/memory_cap.py).
"""
from __future__ import annotations

import ctypes
import gc
from typing import Any

import torch
import torch.distributed as dist

from megatron_ring.perf.bench.harness import measure_peak, track_mmap


def _release_free_heap() -> None:
    """Collect garbage and give glibc's free heap back to the OS, so that the resident size before a
    trial holds no free memory the trial could reuse unseen."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: the baseline may then hold free heap (the peak is a lower bound)
        pass


def _tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def model_config(model_data: dict[str, Any], *, cp: int, seq_len: int) -> Any:
    """The :class:`~megatron_ring.config.gpt.GPTConfig` of a ``configs/megatron`` mapping at tp = pp = 1, ``cp``
    and ``seq_len``; a mapping naming a checkpoint gives the checkpoint's architecture (its config read,
    its weights not: random weights of the same shapes take the same memory). ConfigError naming the field."""
    from megatron_ring.config.gpt import GPTConfig

    where = f"model config at cp = {cp}, seq_len = {seq_len}"
    data = {**model_data, "parallel": {**model_data.get("parallel", {}), "tp": 1, "pp": 1, "cp": cp}}
    if "checkpoint" in data:
        from megatron_ring.training.pretrained import pretrained_gpt_config

        return pretrained_gpt_config(data, seq_len=seq_len, where=where)[0]
    return GPTConfig.parse({**data, "model": {**data.get("model", {}), "seq_length": seq_len}}, where=where)


def train_step_peak(model_data: dict[str, Any], seq_len: int, seed: int) -> dict[str, int]:
    """This rank's peak bytes of one training step at global length ``seq_len``, and its static part.

    ``model_data``: a ``configs/megatron`` mapping (sizes, or a checkpoint: :func:`model_config`); its
    ``parallel`` becomes tp = pp = 1, cp = world size, its ``seq_length`` becomes ``seq_len``. The batch is one sequence ``[1, seq_len]`` of
    random token ids, cut zigzag: this rank's tokens, labels and positions are ``[1, seq_len / cp]``.
    Returns ``peak_bytes`` (what the trial adds at its peak), ``weights_bytes``, ``grads_bytes`` and
    ``optimizer_bytes`` (the tensors' sizes, counted from the tensors), ``local_tokens``.
    """
    from megatron_ring.integrations.megatron.batches import get_batch_on_this_cp_rank
    from megatron_ring.integrations.megatron.model import build_gpt_model
    from megatron_ring.integrations.megatron.state import init_megatron
    from megatron_ring.parallel.layout import ParallelLayout
    from megatron_ring.training.data import masked_loss

    track_mmap()
    cp = dist.get_world_size()
    cfg = model_config(model_data, cp=cp, seq_len=seq_len)
    device = torch.device("cpu")
    groups = init_megatron(ParallelLayout(cp=cp), device=device, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(cfg.model.vocab_size, (1, seq_len + 1), generator=gen)
    batch = get_batch_on_this_cp_rank({"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
                                       "position_ids": torch.arange(seq_len).unsqueeze(0)},
                                      cp_rank=groups.cp_rank, cp_size=cp)
    sizes: dict[str, int] = {}

    def step() -> None:
        model = build_gpt_model(cfg)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-4)
        for p in params:  # the optimizer states exist from the second step of a run on: make them now
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        per_token = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        loss = masked_loss(per_token, torch.ones_like(per_token, dtype=torch.float32)) / seq_len
        loss.backward()
        if cp > 1:
            for p in params:
                dist.all_reduce(p.grad, group=groups.cp)
        sizes.update(weights_bytes=_tensor_bytes(params), grads_bytes=_tensor_bytes(p.grad for p in params),
                     optimizer_bytes=_tensor_bytes(v for state in optimizer.state.values() for v in state.values()))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    _release_free_heap()
    dist.barrier()
    peak = measure_peak(step, device)
    _release_free_heap()
    return {"peak_bytes": peak, **sizes, "local_tokens": seq_len // cp}
