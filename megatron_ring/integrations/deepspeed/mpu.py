"""Our process groups in the shape DeepSpeed's engine asks for: its ``mpu`` object.

Note [Gradients of weights replicated over context-parallel ranks]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every CP rank holds all weights of its TP shard but only 1/cp of each sequence, so its weight
gradients are partial sums over its own tokens: the true gradient is their *sum* over the CP group,
then the *average* over data-parallel replicas. DeepSpeed has exactly this notion for its own
(Ulysses) sequence parallelism, and we reuse it rather than patching the engine:

* ``get_data_parallel_*`` is the pure dp group (size dp): DeepSpeed's batch arithmetic
  ``train_batch_size = micro * grad_accum * dp`` counts whole sequences;
* ``get_sequence_parallel_*`` is the cp group; ``get_sequence_data_parallel_*`` the dp x cp group.
  DeepSpeed all-reduces (ZeRO 0) or reduce-scatters (ZeRO 1/2) gradients over dp x cp, divides by
  ``(dp * cp) / cp = dp``, partitions optimizer states over dp x cp, broadcasts initial weights
  over dp x cp and names ZeRO checkpoint shards by the dp x cp rank (ZeRO-3 needs two corrections:
  Note [ZeRO-3 over dp x cp] in zero3.py);
* ``get_model_parallel_*`` / ``get_tensor_model_parallel_*`` are the tp group (pp is 1 under the
  DeepSpeed engine): checkpoint files are named by the tp rank and gradient norms are summed over
  tp, counting parameters replicated over tp once (Megatron marks the split ones with
  ``tensor_model_parallel``).

So a rank's loss must be its share of the sum over the whole sequence, not a local mean: see
:func:`megatron_ring.training.data.masked_loss`. The object must *not* have
``initialize_sequence_parallel``: DeepSpeed takes that as a different (DeepSpeed-Ulysses) mpu.
"""
from __future__ import annotations

import torch.distributed as dist

from megatron_ring.parallel.groups import ParallelGroups


class DeepSpeedMPU:
    """The ``mpu`` argument of ``deepspeed.initialize`` for a :class:`ParallelGroups` (pp must be 1)."""

    def __init__(self, groups: ParallelGroups) -> None:
        if groups.layout.pp != 1:
            raise ValueError(f"pp = {groups.layout.pp}: DeepSpeed's engine trains one pipeline stage; allowed pp: 1")
        self.groups = groups

    def _rank(self, axis: str) -> int:
        return self.groups.ranks[axis].index(self.groups.rank)

    # tensor (and model) parallel: tp ------------------------------------------------------------

    def get_tensor_model_parallel_group(self) -> dist.ProcessGroup:
        return self.groups.tp

    def get_tensor_model_parallel_rank(self) -> int:
        return self._rank("tp")

    def get_tensor_model_parallel_world_size(self) -> int:
        return self.groups.layout.tp

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.groups.ranks["tp"][0]

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self.groups.tp

    def get_model_parallel_rank(self) -> int:
        return self._rank("tp")

    def get_model_parallel_world_size(self) -> int:
        return self.groups.layout.tp

    # pipeline: a single stage -------------------------------------------------------------------

    def get_pipeline_model_parallel_group(self) -> dist.ProcessGroup:
        return self.groups.pp

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    # data parallel: dp (whole sequences) --------------------------------------------------------

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.groups.dp

    def get_data_parallel_rank(self) -> int:
        return self._rank("dp")

    def get_data_parallel_world_size(self) -> int:
        return self.groups.layout.dp

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(self.groups.ranks["dp"])

    # sequence (context) parallel: cp, and dp x cp for gradients and ZeRO --------------------------

    def get_sequence_parallel_group(self) -> dist.ProcessGroup:
        return self.groups.cp

    def get_sequence_parallel_rank(self) -> int:
        return self.groups.cp_rank

    def get_sequence_parallel_world_size(self) -> int:
        return self.groups.cp_size

    def get_sequence_data_parallel_group(self) -> dist.ProcessGroup:
        return self.groups.dp_cp

    def get_sequence_data_parallel_rank(self) -> int:
        return self._rank("dp-cp")

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.groups.layout.dp * self.groups.layout.cp
