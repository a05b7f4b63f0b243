"""The contract between the inference loop and a model: :class:`ModelRunner`.

The loop (:mod:`megatron_ring.inference.loop`) times prefill and decode, the metrics module
turns the timings into TPS/TTFT/TPOT, and neither knows how the model is parallelised. A runner
hides that: it owns one rank's share of the weights and of the KV cache and answers in *global*
token ids, identical on every rank of the job.

Every rank of the job holds one runner and calls the same methods in the same order with the same
arguments (the loop guarantees this). Greedy decoding only: the next token is
``argmax(logits)``, ties broken towards the lower id, so that every layout produces the same
tokens from the same weights.

Implementations:

* ``megatron_ring.inference.runners.gpt`` — Megatron-core GPT; baseline (TP/PP, full
  sequence on every rank) or ring (CP, prompt sharded zigzag, KV cache sharded over CP ranks,
  decode through :func:`megatron_ring.decode_attention`).
* :mod:`megatron_ring.inference.runners.toy` — a tiny pure-torch GPT over a CP group; an
  independent reference for tests.
* :mod:`megatron_ring.inference.runners.hf` — a transformers causal LM from a local checkpoint;
  TP by DeepSpeed AutoTP, CP by the ring (the transformers adapter).

The config's ``model.runner`` field names a module that provides two functions, together a
:class:`RunnerModule`: ``check_model`` (validate the model against the layout and workload
before anything is built) and ``build_runner`` (a :class:`RunnerFactory`).
"""
from __future__ import annotations

from typing import Any, Optional, Protocol, runtime_checkable

import torch

from megatron_ring.attention.block import resolve_backend
from megatron_ring.integrations.deepspeed.inference_engine import init_inference
from megatron_ring.parallel.groups import ParallelGroups
from megatron_ring.parallel.layout import ParallelLayout


def block_kernel_name(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """``block:<backend>``: the block kernel ``backend="auto"`` picks for these inputs."""
    return f"block:{resolve_backend('auto', device, dtype, head_dim)}"


@runtime_checkable
class ModelRunner(Protocol):
    """One rank's handle on a model being served; all tensors are on :attr:`device`.

    Call order per request: ``reset()``, ``prefill(prompt)``, then ``decode(ids)`` once per new
    token. Arguments and results are identical on every rank of the job.
    """

    vocab_size: int
    """Token ids are in ``[0, vocab_size)``."""

    device: torch.device
    """Where the runner wants its inputs (``cpu`` or ``cuda:<local_rank>``)."""

    attention_kernel: str
    """What computes attention: ``"megatron-local"`` (Megatron's unfused ``DotProductAttention``) or
    ``"block:<backend>"`` (the core's block kernel, e.g. ``block:sdpa``). A fair comparison has the
    same kernel on both sides."""

    module: torch.nn.Module
    """This rank's weights (after :meth:`init_deepspeed`, what DeepSpeed made of them)."""

    tokenizer: Any
    """The checkpoint's tokenizer (transformers' interface), or None for a model without one (random
    weights): text prompts need one."""

    def init_deepspeed(self, ds_config: dict[str, Any]) -> None:
        """Hand :attr:`module` to ``deepspeed.init_inference`` with DeepSpeed's part of the config, once,
        after the process groups exist and before the first request."""
        ...

    def reset(self) -> None:
        """Drop the KV cache; the next call must be :meth:`prefill`."""
        ...

    def prefill(self, prompt_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Run the whole prompt and fill this rank's KV cache.

        prompt_ids: int64 ``[batch, prompt_len]``, the *global* prompt, same on every rank (a CP
        runner takes its own zigzag shard); attention_mask: int64 ``[batch, prompt_len]``, 0 on left
        padding (None: no padding; a runner without padding support raises ValueError for zeros).
        Returns int64 ``[batch]``: the greedy next token after the prompt, same on every rank.
        """
        ...

    def decode(self, ids: torch.Tensor) -> torch.Tensor:
        """Append one token per sequence and return the greedy next one.

        ids: int64 ``[batch]``, the token produced by the previous call, same on every rank.
        Its K/V go into this rank's cache shard (a CP runner appends to the shard that keeps the
        shards balanced). Returns int64 ``[batch]``, same on every rank.
        """
        ...

    def kv_cache_bytes(self) -> int:
        """Bytes this rank's KV cache holds now (allocated capacity, all layers, K and V)."""
        ...


@runtime_checkable
class ScoringRunner(ModelRunner, Protocol):
    """A :class:`ModelRunner` that also scores given tokens (evaluation: log-likelihoods, loss by position).

    Note [Right padding for scores]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    A causal model's prediction at position ``i`` depends on tokens ``<= i`` only, so rows of
    different lengths can share one ``[batch, seq]`` tensor by padding on the *right* with any token:
    the scores of a row's own positions are those of the row alone (up to float rounding of the
    block order), and the caller ignores the tail. No mask, no position shift, and no CP rank
    whose share of a row is all padding; runners that take masks (:attr:`takes_padding`) also score
    left-padded rows.
    """

    takes_padding: bool
    """Whether :meth:`prefill` and :meth:`score` take an ``attention_mask`` with zeros (left padding)."""

    def score(self, ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """What the model predicts at each position of ``ids`` (int64 ``[batch, seq]``, the same on every rank).

        Returns ``(logprob, argmax)``, the same on every rank: float32 ``[batch, seq - 1]``,
        ``log p(ids[:, i + 1] | ids[:, :i + 1])``, and int64 ``[batch, seq]``, the greedy token after
        position ``i`` (ties to the lower id; the last column is the token that would follow the row, so
        greedy generation can recompute instead of caching). Drops any KV cache (:meth:`reset`);
        ``attention_mask`` as in :meth:`prefill` (log-probabilities touching padding are 0, argmax -1).
        """
        ...


class DeepSpeedPassThrough:
    """:meth:`ModelRunner.init_deepspeed` of a runner whose module does its own tensor parallelism
    (Megatron's layers) or none: DeepSpeed converts dtype and placement with ``tp_size = 1``. No
    padding; no tokenizer unless the runner sets one."""

    module: torch.nn.Module
    tokenizer: Any = None

    def init_deepspeed(self, ds_config: dict[str, Any]) -> None:
        init_inference(self.module, ds_config)


def refuse_padding(runner: str, attention_mask: Optional[torch.Tensor]) -> None:
    """ValueError naming ``runner`` when ``attention_mask`` marks padding (a runner without padding support)."""
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise ValueError(f"the {runner} runner takes prompts without padding; got an attention_mask with zeros "
                         "(use the hf runner for padded text prompts)")


class RunnerFactory(Protocol):
    """Builds this rank's runner; called on every rank after the process groups exist.

    model: the runner's model description as a mapping (the YAML of ``configs/megatron/`` named by
    ``model.config``, loaded, or the inline mapping given there); groups: this rank's
    process groups for the validated layout; dtype: compute dtype of weights and activations;
    device: this rank's device; seed: weights are drawn from ``torch.manual_seed(seed)`` so that
    every layout builds the same global model; batch, prompt_len, new_tokens: the largest request
    the runner will serve (size the KV cache for ``prompt_len + new_tokens - 1`` tokens).
    """

    def __call__(self, model: dict[str, Any], groups: ParallelGroups, *, dtype: torch.dtype,
                 device: torch.device, seed: int, batch: int, prompt_len: int,
                 new_tokens: int) -> ModelRunner: ...


class RunnerModule(Protocol):
    """What a runner module (``megatron_ring.inference.<name>_runner``) provides."""

    def check_model(self, model: dict[str, Any], layout: ParallelLayout, *, batch: int, prompt_len: int,
                    new_tokens: int, dtype: Optional[str]) -> dict[str, Any]:
        """Validate the model against the layout, workload and dtype; build nothing, touch no device.

        dtype: the compute dtype of the run (``fp32``, ``bf16``, ``fp16``; None: unknown, not
        checked), which a model that names its own dtype must share. Raise
        :class:`megatron_ring.config.ConfigError` with every problem found, each naming the field,
        its value and what is allowed (e.g. ``num_attention_heads = 6 is not divisible by tp =
        4``; ``num_layers`` not divisible by ``pp``). Return a small JSON-able summary of the
        model for the result file (layers, hidden size, heads, parameter count, ...).
        """
        ...

    build_runner: RunnerFactory

    def takes_text(self, model: dict[str, Any]) -> bool:
        """Whether the runner of ``model`` carries a tokenizer (``workload.text`` prompts); a module
        without this function takes none."""
        ...
