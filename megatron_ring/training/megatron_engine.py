"""``engine: megatron``: a GPT with ring attention trained by Megatron-core's own stack.

What a Megatron-LM user's training runs, built from megatron-core's public pieces:

* the model as pipeline chunks (``virtual_pipeline`` chunks per stage: interleaved 1F1B), every
  layout started from the same weights (Note [Initial weights of any layout] in
  :mod:`megatron_ring.integrations.megatron.model`), or from a pretrained transformers checkpoint's
  when the model file names one (:mod:`megatron_ring.training.pretrained`: the inference runner's
  converter, each rank given its TP shard and PP stage), activation recomputation as configured;
* ``dtype: bf16`` in the model file: bf16 weights and activations (``Float16Module``), fp32 main
  weights and Adam states in Megatron's optimizer (``Float16OptimizerWithFloat16Params``, or the
  ``DistributedOptimizer``'s sharded fp32 main weights), gradients reduced in fp32; it runs on CPU;
* each chunk in megatron-core's ``DistributedDataParallel``: gradients in contiguous buckets,
  reduced (all-reduce, or reduce-scatter with the distributed optimizer) over dp x cp while the
  backward still runs (``overlap_grad_reduce``);
* ``get_megatron_optimizer``: Adam or SGD, the ``DistributedOptimizer`` (main weights and states
  sharded over dp x cp) when asked, gradient clipping; Megatron's ``OptimizerParamScheduler``;
* ``get_forward_backward_func``: no pipelining, 1F1B or interleaved 1F1B over the step's
  micro-batches, with ``calculate_per_token_loss``: each micro-batch returns its summed loss and
  its valid-token count, and ``finalize_model_grads`` divides the reduced gradients by the global
  count, so the gradient is that of the global mean token loss at every layout (the DeepSpeed
  engine gets the same by scaling, Note [The loss of a context-parallel rank] in
  :mod:`megatron_ring.training.global_loss`);
* ``dist_checkpointing``: every rank writes its shards of the model and of the optimizer state
  (``fully_sharded_model_space``: each shard a piece of the unsharded parameter's state), so a
  checkpoint loads at any other tp / pp / cp / dp layout. Rank 0 adds the model's config and, for a
  pretrained model, its transformers config and tokenizer (:data:`~megatron_ring.training.pretrained.MODEL_FILE`,
  :data:`TOKENIZER_DIR`), which :mod:`megatron_ring.training.export_megatron` turns back into a
  transformers checkpoint.

On a CPU-only process these calls run inside
:func:`~megatron_ring.integrations.megatron.on_cpu.cuda_calls_on_cpu` (Note [Megatron-core on
CPU]); on a GPU nothing is changed. :class:`MegatronTrainer` is an
:class:`~megatron_ring.training.engine.Engine`, so checkpoints, markers and digests are shared with
the DeepSpeed engine.
"""
from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from megatron_ring.integrations.megatron.on_cpu import cuda_calls_on_cpu
from megatron_ring.parallel.groups import ParallelGroups
from megatron_ring.training.data import Batch, masked_loss
from megatron_ring.training.global_loss import global_mean, global_sums

if TYPE_CHECKING:
    from megatron_ring.training.schema import TrainSpec

TRAIN_STATE = "train_state.json"
"""File of a Megatron-engine checkpoint holding the loop's client state and the scheduler's state."""
TOKENIZER_DIR = "tokenizer"
"""Folder of a Megatron-engine checkpoint holding the pretrained model's tokenizer (``save_pretrained``)."""


class MegatronTrainer:
    """One rank's Megatron-core training (:class:`~megatron_ring.training.engine.Engine`): model chunks in DDP,
    optimizer, scheduler, schedule.

    Batches are this rank's micro-batches ``[micro, seq_len / cp]`` (:class:`~megatron_ring.training.data.Batch`).
    """

    name = "megatron"
    reshards = True  # dist_checkpointing: a checkpoint loads at any layout

    def __init__(self, spec: "TrainSpec", groups: ParallelGroups, device: torch.device) -> None:
        from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
        from megatron.core.optimizer import get_megatron_optimizer
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from megatron_ring.integrations.megatron.model import build_gpt_model, initialize_by_name, load_full_state_dict
        from megatron_ring.training.pretrained import load_pretrained_weights

        section = spec.train.megatron
        self.spec, self.groups, self.device = spec, groups, device
        weights, self.tokenizer = load_pretrained_weights(spec.pretrained) if spec.pretrained else (None, None)
        chunks = section.virtual_pipeline or 1
        with cuda_calls_on_cpu():
            modules = [build_gpt_model(spec.model, vp_stage=i if chunks > 1 else None, calculate_per_token_loss=True,
                                       **section.transformer_overrides(chunks))
                       for i in range(chunks)]
            for module in modules:
                if weights is None:
                    initialize_by_name(module, spec.train.seed)
                else:  # this rank's TP shard and PP stage of the checkpoint (vp chunks by global layer)
                    load_full_state_dict(module, weights)
            del weights
            ddp = section.ddp.megatron_config(use_distributed_optimizer=section.optimizer.use_distributed_optimizer)
            self.model = [DistributedDataParallel(config=module.config, ddp_config=ddp, module=module)
                          for module in modules]
            self.optimizer = get_megatron_optimizer(section.optimizer.megatron_config(spec.model.dtype), self.model,
                                                    use_gloo_process_groups=False)
        self.scheduler = section.scheduler.build(self.optimizer, section.optimizer, spec.train.steps)
        config = self.model[0].config
        config.no_sync_func = [m.no_sync for m in self.model] if chunks > 1 else self.model[0].no_sync
        config.finalize_model_grads_func = finalize_model_grads
        config.grad_scale_func = self.optimizer.scale_loss
        if section.ddp.overlap_param_gather:
            config.param_sync_func = [m.start_param_sync for m in self.model] if chunks > 1 \
                else self.model[0].start_param_sync
        self._forward_backward = get_forward_backward_func()

    # --- what the loop uses -----------------------------------------------------------------

    @property
    def module(self) -> torch.nn.Module:
        """The first model chunk (a GPTModel, or its Float16Module), unwrapped from DDP."""
        return self.model[0].module

    @property
    def model_chunks(self) -> list[torch.nn.Module]:
        """Every model chunk of this rank, unwrapped from DDP."""
        return [m.module for m in self.model]

    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def step(self, batches: Sequence[Batch]) -> float:
        """Forward, backward and optimizer step over this rank's micro-batches; the global mean token loss."""
        with cuda_calls_on_cpu():
            for chunk in self.model:
                chunk.zero_grad_buffer()
            self.optimizer.zero_grad()
            sums = self._schedule(batches, forward_only=False)
            updated, _, _ = self.optimizer.step()
        if updated:
            self.scheduler.step(increment=1)
        total = global_sums(self._local_sums(sums), self.groups)
        return global_mean(total[0], total[1])

    def eval_sums(self, batches: Sequence[Batch]) -> torch.Tensor:
        """Forward only over this rank's micro-batches (eval mode): this rank's ``[loss sum, token count]``
        (float64; zeros but on the last pipeline stage)."""
        with cuda_calls_on_cpu():
            for chunk in self.model:
                chunk.eval()
            with torch.no_grad():
                sums = self._schedule(batches, forward_only=True)
            for chunk in self.model:
                chunk.train()
        return self._local_sums(sums)

    def save(self, ckpt_dir: Path, tag: str, client_state: dict[str, Any]) -> None:
        """Every rank's shards into ``ckpt_dir/tag`` (``dist_checkpointing``) plus :data:`TRAIN_STATE`."""
        from megatron.core import dist_checkpointing

        folder = Path(ckpt_dir) / tag
        if dist.get_rank() == 0:
            folder.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        with cuda_calls_on_cpu():
            dist_checkpointing.save(self._sharded_state(is_loading=False), str(folder))
        if dist.get_rank() == 0:
            state = {"client": client_state, "scheduler": self.scheduler.state_dict()}
            (folder / TRAIN_STATE).write_text(json.dumps(state))
            self._save_model_description(folder)
        dist.barrier()

    def load(self, ckpt_dir: Path, tag: str) -> dict[str, Any]:
        """Load ``ckpt_dir/tag`` (saved at any layout) into this rank's chunks and optimizer; the client state."""
        from megatron.core import dist_checkpointing

        folder = Path(ckpt_dir) / tag
        state = json.loads((folder / TRAIN_STATE).read_text())
        with cuda_calls_on_cpu():
            self._create_optimizer_states()
            for optimizer in self._distributed_optimizers():
                _keep_step_on_load(optimizer)
            loaded = dist_checkpointing.load(self._sharded_state(is_loading=True), str(folder))
            for key, module in zip(self._model_keys(), self.model_chunks):
                module.load_state_dict(loaded[key])
            self.optimizer.load_state_dict(loaded["optimizer"])
            for optimizer in self._distributed_optimizers():
                _own_step_tensors(optimizer)
        self.scheduler.load_state_dict(state["scheduler"])
        return state["client"]

    def _save_model_description(self, folder: Path) -> None:
        """Rank 0: :data:`~megatron_ring.training.pretrained.MODEL_FILE` (the model's config, the checkpoint it
        came from, its transformers config) and the tokenizer into ``folder``, for the export."""
        from megatron_ring.training.pretrained import MODEL_FILE

        pretrained = self.spec.pretrained
        description = {"gpt": self.spec.model.model_dump(mode="json"),
                       "source": pretrained.source.model_dump(mode="json") if pretrained else None,
                       "hf_config": pretrained.hf_config if pretrained else None}
        (folder / MODEL_FILE).write_text(json.dumps(description, indent=1, default=str))
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(folder / TOKENIZER_DIR)

    def destroy(self) -> None:
        """Drop the model, optimizer, scheduler and their buffers, so that the process groups they hold
        can end (a worker serving many runs calls it).

        Megatron's ``RotaryEmbedding.forward`` is an ``lru_cache`` keyed on the module itself: it keeps
        the last 32 models alive, and through the hooks on their config (``no_sync_func``, ...) the DDP
        buffers and every process group they use. The hooks are cleared and the cache emptied.
        """
        from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

        for chunk in self.model:
            for hook in ("no_sync_func", "finalize_model_grads_func", "grad_scale_func", "param_sync_func"):
                setattr(chunk.config, hook, None)
        RotaryEmbedding.forward.cache_clear()
        self.model, self.optimizer, self.scheduler = [], None, None

    # --- the schedule and its callbacks --------------------------------------------------------

    def _schedule(self, batches: Sequence[Batch], *, forward_only: bool) -> list[dict[str, torch.Tensor]]:
        """Megatron's schedule (no pipelining, 1F1B or interleaved) over this rank's micro-batches; the last
        stage's loss dicts."""
        iterators: list[Iterator[Batch]] = [iter(batches) for _ in self.model]
        return self._forward_backward(
            forward_step_func=self._forward_step,
            data_iterator=iterators if len(self.model) > 1 else iterators[0],
            model=self.model if len(self.model) > 1 else self.model[0],
            num_microbatches=len(batches), seq_length=batches[0].tokens.shape[1] * self.groups.layout.cp,
            micro_batch_size=self.spec.micro_batch, forward_only=forward_only)

    def _forward_step(self, data_iterator: Iterator[Batch], model: torch.nn.Module) -> tuple[torch.Tensor, Callable]:
        """One micro-batch through this chunk: per-token losses ``[micro, s_local]`` on the last stage,
        hidden states ``[s_local, micro, h]`` elsewhere, and the loss function Megatron calls on them."""
        from megatron_ring.integrations.megatron.packed import packed_seq_params

        batch = next(data_iterator).to(self.device)
        output = model(batch.tokens, batch.position_ids, None, labels=batch.labels,
                       packed_seq_params=packed_seq_params(batch.cu_seqlens))  # Note [Packed training rows]
        return output, partial(_summed_loss, batch.loss_mask)

    def _local_sums(self, sums: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """This rank's ``[sum, count]`` of the micro-batches (float64): the last stage's, zeros elsewhere."""
        total = torch.zeros(2, dtype=torch.float64, device=self.device)
        for item in sums:
            total += item["lm loss"].double()
        return total

    def _create_optimizer_states(self) -> None:
        """Give a fresh distributed optimizer its states (and step count) before a load fills them.

        Note [Loading into a fresh optimizer]: torch's Adam creates its states at the first step,
        and Megatron's ``DistributedOptimizer.state_dict`` (which the sharded state dict of a load
        starts from) needs them, step count included. Megatron's own remedy, a step on zero
        gradients (``_init_optimizer_states_with_dummy_values``), is what Megatron runs for its
        other formats; the values it leaves are all overwritten by the load.
        """
        for optimizer in self._distributed_optimizers():
            if not optimizer.optimizer.state:
                optimizer._init_optimizer_states_with_dummy_values()

    def _distributed_optimizers(self) -> list[Any]:
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        chained = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        return [optimizer for optimizer in chained if isinstance(optimizer, DistributedOptimizer)]

    def _model_keys(self) -> list[str]:
        return ["model"] if len(self.model) == 1 else [f"model{i}" for i in range(len(self.model))]

    def _sharded_state(self, *, is_loading: bool) -> dict[str, Any]:
        """Megatron's sharded state dict of this rank: model chunk(s) and optimizer (model-space shards)."""
        state: dict[str, Any] = {key: module.sharded_state_dict() for key, module in zip(self._model_keys(), self.model_chunks)}
        state["optimizer"] = self.optimizer.sharded_state_dict(
            state, is_loading=is_loading, metadata={"distrib_optim_sharding_type": "fully_reshardable"})
        return state


def _summed_loss(loss_mask: torch.Tensor, per_token: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Megatron's per-token loss function: ``(sum of valid tokens' losses, their count, {"lm loss": [sum, count]})``."""
    mask = loss_mask.to(per_token.device)
    local = masked_loss(per_token, mask)
    count = mask.sum().to(torch.int)
    return local, count, {"lm loss": torch.stack([local.detach(), count.float()])}


def _keep_step_on_load(optimizer: Any) -> None:
    """Let ``optimizer`` (a DistributedOptimizer over torch's Adam) load a ``fully_reshardable`` state.

    Note [The step of torch's Adam on load]: with torch's Adam (no Transformer Engine or Apex, as on
    CPU) every parameter's state holds a ``step`` tensor, which Adam's bias correction reads and
    each step increments in place. Megatron's load goes wrong twice there:

    * it sets the step from the saved param groups, then copies each parameter's saved tensors into
      *every* key of its state, ``step`` included, which the saved tensors leave out on purpose: a
      KeyError. Here the copy of ``step`` is given the value just set, so it copies onto itself;
    * it gives every parameter *the same* step tensor, so the next optimizer step increments it once
      per parameter and the bias correction is wrong from then on (the ranks' steps then also
      disagree at the next save). :func:`_own_step_tensors` gives each parameter its own copy.
    """
    original = optimizer._set_main_param_and_optimizer_states

    def set_states(model_param: torch.nn.Parameter, tensors: dict[str, torch.Tensor]) -> None:
        group, order = optimizer.model_param_group_index_map[model_param]
        state = optimizer.optimizer.state[optimizer.optimizer.param_groups[group]["params"][order]]
        if "step" in state and "step" not in tensors:
            tensors = {**tensors, "step": state["step"]}
        original(model_param, tensors)

    optimizer._set_main_param_and_optimizer_states = set_states


def _own_step_tensors(optimizer: Any) -> None:
    """Give every parameter of ``optimizer`` its own ``step`` tensor (Note [The step of torch's Adam on load])."""
    for state in optimizer.optimizer.state.values():
        if "step" in state:
            state["step"] = state["step"].clone()
