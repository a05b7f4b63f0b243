"""The ``megatron_ring.megatron`` section of a training config: Megatron-core's optimizer, DDP,
scheduler, recomputation and virtual pipeline for ``engine: megatron``.

Field names follow Megatron-LM's arguments (``--lr``, ``--adam-beta1``, ``--clip-grad``,
``--use-distributed-optimizer``, ``--overlap-grad-reduce``, ``--recompute-granularity``,
``--num-layers-per-virtual-pipeline-stage`` as chunks per stage, ...). Importing this module needs
pydantic and the config schemas only; building the Megatron objects imports megatron-core.

Note [Interleaved p2p at pp = 2]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
In the steady state of the interleaved schedule a stage sends and receives in both directions in
one call (``send_forward_backward_recv_forward_backward``): an activation to ``next``, a gradient
to ``prev``, and receives one of each. With megatron-core's default ``batch_p2p_comm=True`` the
four ops go into one ``batch_isend_irecv`` in the order send-prev, recv-prev, send-next, recv-next,
untagged; messages between one pair of ranks match in the order they were posted. At pp = 2
``prev`` and ``next`` are the same peer, so stage 0's first message to stage 1 (its gradient, for
stage 1 as ``next``) lands in stage 1's first receive from stage 0 (``recv_prev``: an activation),
and the other way round: the two tensors of equal shape swap silently (Megatron-LM issue #750;
here, pp2 x vp2 x cp2, step 1's loss was 4.904 with 4 micro-batches and 4.905 with 8 instead of cp
1's 4.891). At pp > 2 ``prev`` and ``next`` differ, so
between two ranks one call carries at most one message each way and nothing can swap; the
non-interleaved 1F1B schedule never sends both ways in one call. Only interleaving at pp = 2 is
exposed, but Megatron-LM itself interleaves with ``overlap_p2p_comm=True, batch_p2p_comm=False``
at every pp (its ``--overlap-p2p-communication`` default), and so do we: one setting for every
interleaved layout. Without batching, megatron-core posts separate isend/irecv in an even/odd rank
order and, at pp = 2, sends the two directions over two different groups (the pp group and the
world), so each receive gets the tensor meant for it: pp2 x vp2 x cp2 then equals cp 1 at 4 and
8 micro-batches, and so does pp 4 x vp2 (tests/integration/test_train_megatron.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Optional

from pydantic import Field

from megatron_ring.config import StrictModel
from megatron_ring.config.gpt import CpCommType

if TYPE_CHECKING:
    from megatron_ring.config.gpt import GPTConfig


INTERLEAVED_P2P: dict[str, bool] = {"overlap_p2p_comm": True, "batch_p2p_comm": False}
"""The p2p options of every interleaved pipeline (Note [Interleaved p2p at pp = 2])."""


class OptimizerSection(StrictModel):
    """Megatron's ``OptimizerConfig``: Adam (decoupled weight decay, as Megatron's) or SGD."""

    type: Literal["adam", "sgd"] = "adam"
    lr: float = Field(..., gt=0, description="peak learning rate")
    min_lr: float = Field(0.0, ge=0, description="floor of the decay (scheduler.decay_style linear / cosine)")
    weight_decay: float = Field(0.01, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    adam_eps: float = Field(1e-8, gt=0)
    sgd_momentum: float = Field(0.9, ge=0)
    clip_grad: float = Field(1.0, ge=0, description="global gradient-norm clip; 0: none")
    use_distributed_optimizer: bool = Field(True, description="shard main weights and states over dp x cp")

    def megatron_config(self, dtype: str) -> Any:
        from megatron.core.optimizer import OptimizerConfig

        return OptimizerConfig(optimizer=self.type, lr=self.lr, min_lr=self.min_lr, weight_decay=self.weight_decay,
                               adam_beta1=self.adam_beta1, adam_beta2=self.adam_beta2, adam_eps=self.adam_eps,
                               sgd_momentum=self.sgd_momentum, clip_grad=self.clip_grad,
                               use_distributed_optimizer=self.use_distributed_optimizer,
                               bf16=dtype == "bf16", fp16=dtype == "fp16")


class DDPSection(StrictModel):
    """Megatron's ``DistributedDataParallelConfig``."""

    overlap_grad_reduce: bool = Field(True, description="reduce each gradient bucket as soon as it is ready")
    overlap_param_gather: bool = Field(False, description="distributed optimizer: gather updated weights during "
                                                          "the next forward")
    bucket_size: Optional[int] = Field(None, ge=1, description="elements per gradient bucket; None: Megatron's default")
    grad_reduce_in_fp32: bool = Field(True, description="reduce bf16/fp16 gradients in fp32")

    def megatron_config(self, *, use_distributed_optimizer: bool) -> Any:
        from megatron.core.distributed import DistributedDataParallelConfig

        return DistributedDataParallelConfig(
            use_distributed_optimizer=use_distributed_optimizer, overlap_grad_reduce=self.overlap_grad_reduce,
            overlap_param_gather=self.overlap_param_gather and use_distributed_optimizer,
            bucket_size=self.bucket_size, grad_reduce_in_fp32=self.grad_reduce_in_fp32)


class SchedulerSection(StrictModel):
    """Megatron's ``OptimizerParamScheduler``: linear warm-up to ``optimizer.lr``, then a decay to
    ``optimizer.min_lr`` at the last step (``constant``: none). Counted in optimizer steps."""

    warmup_steps: int = Field(0, ge=0)
    decay_style: Literal["constant", "linear", "cosine"] = "constant"

    def build(self, optimizer: Any, opt: OptimizerSection, steps: int) -> Any:
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        return OptimizerParamScheduler(
            optimizer, init_lr=0.0 if self.warmup_steps else opt.lr, max_lr=opt.lr, min_lr=opt.min_lr,
            lr_warmup_steps=self.warmup_steps, lr_decay_steps=max(steps, self.warmup_steps + 1),
            lr_decay_style=self.decay_style, start_wd=opt.weight_decay, end_wd=opt.weight_decay,
            wd_incr_steps=steps, wd_incr_style="constant")


class RecomputeSection(StrictModel):
    """Activation recomputation (Megatron's ``recompute_granularity`` / ``_method`` / ``_num_layers``)."""

    granularity: Optional[Literal["full", "selective"]] = Field(
        None, description="full: whole layers; selective: the core attention; None: keep activations")
    method: Optional[Literal["uniform", "block"]] = Field(None, description="full: which layers (needed with full)")
    num_layers: Optional[int] = Field(None, ge=1, description="full: layers per group (uniform) or per stage (block)")


class MegatronSection(StrictModel):
    """Our ``megatron_ring.megatron`` section (``engine: megatron`` only)."""

    optimizer: OptimizerSection
    ddp: DDPSection = Field(default_factory=DDPSection)
    scheduler: SchedulerSection = Field(default_factory=SchedulerSection)
    recompute: RecomputeSection = Field(default_factory=RecomputeSection)
    virtual_pipeline: Optional[int] = Field(None, ge=2, description="model chunks per pipeline stage "
                                                                     "(interleaved 1F1B); None: one")
    sequence_parallel: Optional[bool] = Field(None, description="Megatron's sequence_parallel (needs tp > 1); None: "
                                              "the model file's parallel.sequence_parallel")
    cp_comm_type: Optional[CpCommType | list[CpCommType]] = Field(None, description="Megatron's cp_comm_type; None: "
                                                                  "the model file's parallel.cp_comm_type")

    def problems(self, model: "GPTConfig", *, grad_accum: int, where: str) -> list[str]:
        """What Megatron would reject only once the model is built, each naming the field."""
        found = []
        opt = self.optimizer
        if opt.min_lr > opt.lr:
            found.append(f"{where}.optimizer.min_lr = {opt.min_lr} is above optimizer.lr = {opt.lr}: the decay would "
                         "raise the learning rate; allowed: min_lr <= lr")
        rc, pp = self.recompute, model.parallel.pp
        if rc.granularity == "full" and (rc.method is None or rc.num_layers is None):
            found.append(f"{where}.recompute.granularity = 'full' needs recompute.method ('uniform' or 'block') and "
                         f"recompute.num_layers; got method = {rc.method!r}, num_layers = {rc.num_layers!r}")
        if rc.granularity != "full" and (rc.method is not None or rc.num_layers is not None):
            found.append(f"{where}.recompute.method / num_layers apply to granularity 'full' only; "
                         f"granularity = {rc.granularity!r}")
        if self.virtual_pipeline is not None:
            if pp == 1:
                found.append(f"{where}.virtual_pipeline = {self.virtual_pipeline} needs layout.pp > 1")
            elif model.model.num_layers % (pp * self.virtual_pipeline):
                found.append(f"{where}.virtual_pipeline = {self.virtual_pipeline}: model.num_layers = "
                             f"{model.model.num_layers} is not divisible by pp * virtual_pipeline = "
                             f"{pp * self.virtual_pipeline}")
            if grad_accum % pp:
                found.append(f"{where}.virtual_pipeline = {self.virtual_pipeline}: the interleaved schedule runs the "
                             f"micro-batches in groups of layout.pp = {pp} (megatron-core's "
                             f"microbatch_group_size_per_vp_stage), so gradient_accumulation_steps (micro-batches per "
                             f"step) must be a multiple of {pp}, got {grad_accum}")
        if isinstance(model.parallel.cp_comm_type, list) and self.virtual_pipeline is not None:
            found.append(f"{where}.virtual_pipeline with a per-layer parallel.cp_comm_type list is not supported; "
                         "give one cp_comm_type")
        return found

    def transformer_overrides(self, chunks: int) -> dict[str, Any]:
        """``TransformerConfig`` fields for the recomputation and the virtual pipeline (with its p2p
        options: Note [Interleaved p2p at pp = 2])."""
        rc = self.recompute
        out: dict[str, Any] = {}
        if rc.granularity is not None:
            out.update(recompute_granularity=rc.granularity, recompute_method=rc.method,
                       recompute_num_layers=rc.num_layers)
        if chunks > 1:
            out.update(virtual_pipeline_model_parallel_size=chunks, **INTERLEAVED_P2P)
        return out
