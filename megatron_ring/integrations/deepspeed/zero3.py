"""ZeRO stage 3 with weights replicated over context-parallel ranks: partitions and gradient divisor.

Note [ZeRO-3 over dp x cp]
~~~~~~~~~~~~~~~~~~~~~~~~~~
ZeRO-3 partitions the parameters themselves, and a parameter's partition group is also the group
its gradient is reduced over. Two things in DeepSpeed's engine are wrong for our layouts with
cp > 1 (Note [Gradients of weights replicated over context-parallel ranks] in mpu.py), and both
were measured on the 4-rank tiny GPT (cp 2 x dp 2, one step's full gradients against ZeRO-0):

1. A model that was not built under ``deepspeed.zero.Init`` is partitioned by the engine over
   ``mpu.get_data_parallel_group()``: the pure dp group, not dp x cp. Each parameter remembers that
   group (``ds_process_group``) and ZeRO-3 reduces its gradient there, so the CP partial gradients
   are never summed: every weight's gradient was off by 10-50 % (relative to ZeRO-0), and the run
   trained to a different loss. :func:`partition_over_dp_cp` partitions the model over dp x cp
   first (``zero.Init(module=..., data_parallel_group=dp x cp)``, which broadcasts each weight from
   the group's first rank like the engine's own initial broadcast); the engine then keeps it.
2. Over that group ZeRO-3's reduce-scatter path (``reduce_scatter: true``, its default) divides
   the summed gradient by the group size dp * cp and never multiplies the cp back, while its
   all-reduce path (``reduce_scatter: false``, only for buckets within ``reduce_bucket_size``) and
   stages 0-2 divide by dp. With ``reduce_scatter: true`` every bucket takes the reduce-scatter
   path, so the divisor is known: :func:`gradient_divisor_excess` is cp, and the loss of a rank is
   scaled up by it (Note [The loss of a context-parallel rank] in training/global_loss.py). With
   ``reduce_scatter: false`` a bucket's path depends on parameter sizes, so that combination is
   refused (:func:`zero3_problems`).

After both, ZeRO-3 trains like ZeRO-0 at cp 2 x dp 2 and tp 2 x cp 2 (tests/integration/test_train_zero3.py).
"""
from __future__ import annotations

from typing import Any

import torch

from megatron_ring.integrations.deepspeed.mpu import DeepSpeedMPU


def zero_stage(ds_config: dict[str, Any]) -> int:
    """The ZeRO stage a DeepSpeed config mapping selects (0 when it has no ``zero_optimization``)."""
    return int((ds_config.get("zero_optimization") or {}).get("stage", 0))


def zero3_problems(ds_config: dict[str, Any], cp: int) -> list[str]:
    """Why ``ds_config`` cannot train at ``cp`` under ZeRO-3, each naming the key (none: [] ): the
    all-reduce path at cp > 1 (see the Note), and what DeepSpeed's stage 3 asserts only once the engine is
    built: ``prescale_gradients``, a ``gradient_predivide_factor`` other than 1, NVMe offload without the
    async I/O op."""
    if zero_stage(ds_config) != 3:
        return []
    zero, found = ds_config.get("zero_optimization") or {}, []
    if cp > 1 and not zero.get("reduce_scatter", True):
        found.append(f"zero_optimization.reduce_scatter = false with stage 3 and cp = {cp}: ZeRO-3 then divides a "
                     "gradient bucket by dp or by dp * cp depending on its size, so the gradient over the "
                     "context-parallel ranks is not known; allowed: true (the default)")
    if ds_config.get("prescale_gradients"):
        found.append("prescale_gradients = true with zero_optimization.stage = 3: DeepSpeed's stage 3 does not "
                     "support it (its engine would assert at start); allowed: false")
    factor = ds_config.get("gradient_predivide_factor", 1.0)
    if factor != 1.0:
        found.append(f"gradient_predivide_factor = {factor} with zero_optimization.stage = 3: DeepSpeed's stage 3 "
                     "does not support it (its engine would assert at start); allowed: 1.0")
    nvme = [f"zero_optimization.{key}.device" for key in ("offload_param", "offload_optimizer")
            if isinstance(zero.get(key), dict) and zero[key].get("device") == "nvme"]
    if nvme and not async_io_available():
        found.append(f"{' and '.join(nvme)} = 'nvme' needs DeepSpeed's async I/O op (libaio), which this "
                     "installation cannot build; allowed: 'cpu' or 'none'")
    return found


def async_io_available() -> bool:
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder

        return bool(AsyncIOBuilder().is_compatible(verbose=False))
    except Exception:  # an op builder that cannot even be asked cannot build either
        return False


def partition_over_dp_cp(model: torch.nn.Module, mpu: DeepSpeedMPU, ds_config: dict[str, Any]) -> None:
    """Under ZeRO-3, partition ``model``'s parameters over dp x cp in place (weights broadcast from the
    group's first rank); other stages leave it alone. Call before ``deepspeed.initialize``."""
    if zero_stage(ds_config) != 3:
        return
    import deepspeed

    deepspeed.zero.Init(module=model, data_parallel_group=mpu.get_sequence_data_parallel_group(),
                        config_dict_or_path=ds_config, mpu=mpu)


def gradient_divisor_excess(engine: Any, cp: int) -> int:
    """By what factor ``engine`` divides the dp x cp gradient sum beyond dp: ``cp`` under ZeRO-3 (its
    reduce-scatter path, Note [ZeRO-3 over dp x cp]), else 1."""
    if engine.zero_optimization_stage() == 3 and engine.zero_reduce_scatter():
        return cp
    return 1
