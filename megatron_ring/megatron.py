"""Megatron-core integration (needs megatron-core): ``from megatron_ring.megatron import get_gpt_layer_ring_spec``.

Re-exports :mod:`megatron_ring.integrations.megatron` and the config-driven model builder; see
``docs/megatron.md``.
"""
from megatron_ring.integrations.megatron import (
    CP_COMM_TYPES,
    RingAttention,
    gather_logits,
    gather_sequence,
    get_batch_on_this_cp_rank,
    get_gpt_layer_ring_spec,
    gpt_layer_ring_spec,
    parallel_from_megatron,
    use_ring_attention,
)
from megatron_ring.integrations.megatron_model import build_gpt_model, load_full_state_dict, transformer_config

__all__ = [
    "CP_COMM_TYPES",
    "RingAttention",
    "build_gpt_model",
    "gather_logits",
    "gather_sequence",
    "get_batch_on_this_cp_rank",
    "get_gpt_layer_ring_spec",
    "gpt_layer_ring_spec",
    "load_full_state_dict",
    "parallel_from_megatron",
    "transformer_config",
    "use_ring_attention",
]


def _demo() -> None:
    """``torchrun --nproc_per_node N -m megatron_ring.megatron CONFIG.yaml``: CPU/gloo check of a config.

    Builds the config's model and the cp = 1 Megatron reference with the same weights, runs one
    batch through both and prints loss, logits and gradient differences (see docs/megatron.md).
    """
    import argparse
    import os
    from datetime import timedelta

    import torch.distributed as dist

    from megatron_ring.config import load_mapping
    from megatron_ring.testing.megatron_cpu import compare_to_reference

    parser = argparse.ArgumentParser(prog="python -m megatron_ring.megatron", description=_demo.__doc__)
    parser.add_argument("config", help="a configs/megatron YAML/JSON file")
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    if "RANK" not in os.environ:
        parser.error("start it with torchrun, e.g. torchrun --nproc_per_node 2 -m megatron_ring.megatron CONFIG")
    dist.init_process_group("gloo", timeout=timedelta(minutes=5))
    result = compare_to_reference(load_mapping(args.config), batch=args.batch)
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, result)
    if dist.get_rank() == 0:
        for r in results:
            loss = f"loss {r['loss']:.6f} (cp=1 reference {r['ref_loss']:.6f}), logits rel err {r['logits_err']:.1e}, " \
                if "loss" in r else ""
            print(f"rank {r['rank']}: {loss}max grad rel err {r['grad_err']:.1e} ({r['grad_worst']})")
    dist.destroy_process_group()


if __name__ == "__main__":
    _demo()
