"""``megatron-ring export CHECKPOINT OUT_DIR``: a training checkpoint as a transformers checkpoint.

::

    megatron-ring export runs/ft/ckpt out/ft            # the latest complete step of a checkpoint.dir
    megatron-ring export runs/ft/ckpt/step00000040 out/ft

writes ``OUT_DIR/config.json``, ``model.safetensors`` (fp32) and, when the model started from a
pretrained checkpoint, its tokenizer files, which ``AutoModelForCausalLM.from_pretrained(OUT_DIR)``
and the project's ``hf`` runner load. It runs offline in this one process, whatever the layout
the checkpoint was saved at.

What a checkpoint is comes from what it stores: its ``complete.json`` marker (Note [Complete
checkpoints] in :mod:`megatron_ring.training.checkpoint`) names the ``engine`` and, for a
transformers model, its config and the pretrained checkpoint it started from
(:func:`megatron_ring.training.loop.model_record`). A marker written before it named the engine
is told by its files (DeepSpeed's ``*_model_states.pt``).

Note [Which weights an export takes]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The exported weights are the optimizer's fp32 master weights wherever DeepSpeed keeps them apart
from the module: under ZeRO 1-3 and under ``bf16`` (whose module holds bf16 copies) they are
gathered from the ``*_optim_states.pt`` partitions, one per dp x cp rank, with DeepSpeed's own
``zero_to_fp32`` (ZeRO-3's partition count is dp x cp here: Note [ZeRO-3 over dp x cp] in
:mod:`megatron_ring.integrations.deepspeed.zero3`; the files say how many). DeepSpeed's bf16
optimizer at ZeRO stage 0 stores its partitions in the ZeRO-2 layout without naming a stage, so
they are merged as ZeRO-2's. fp32 at stage 0 keeps the module's weights, which are the trained
ones. An exported model thus holds exactly the values training would continue from.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_ring.training.checkpoint import (COMPLETE, CheckpointError, checkpoint_engine, latest_checkpoint,
                                                read_marker)



def find_tag(checkpoint: Path) -> tuple[Path, str]:
    """``(checkpoint dir, tag)`` of ``checkpoint``: a step folder with a complete marker, or a training
    ``checkpoint.dir`` (its latest complete step). ValueError naming the path otherwise."""
    if not checkpoint.exists():
        raise ValueError(f"CHECKPOINT = {str(checkpoint)!r} does not exist; give a training checkpoint.dir or one of "
                         "its step folders")
    if (checkpoint / COMPLETE).is_file():
        return checkpoint.parent, checkpoint.name
    if checkpoint.is_dir() and (tag := latest_checkpoint(checkpoint)) is not None:
        return checkpoint, tag
    if checkpoint.is_dir() and checkpoint.name.startswith("step"):
        raise ValueError(f"CHECKPOINT = {str(checkpoint)!r} has no {COMPLETE}: its save did not finish on every rank; "
                         "give a complete step")
    raise ValueError(f"CHECKPOINT = {str(checkpoint)!r} is not a training checkpoint (no step folder with "
                     f"{COMPLETE}); give a training checkpoint.dir or one of its step folders")


def check_out_dir(out_dir: Path) -> None:
    """ValueError unless ``out_dir`` is absent or an empty folder (an export never overwrites)."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ValueError(f"OUT_DIR = {str(out_dir)!r} exists and is not an empty folder; give a new folder")


def export_checkpoint(checkpoint: Path, out_dir: Path) -> Path:
    """Write the transformers checkpoint of a training checkpoint (either engine, any layout) into ``out_dir``;
    return ``out_dir``. ValueError naming the path and what is wrong."""
    ckpt_dir, tag = find_tag(checkpoint)
    check_out_dir(out_dir)
    marker = read_marker(ckpt_dir / tag)
    if checkpoint_engine(marker, ckpt_dir / tag) == "megatron":
        try:
            from megatron_ring.training.export_megatron import export_megatron_checkpoint
        except ModuleNotFoundError as err:
            if err.name != "megatron_ring.training.export_megatron":
                raise
            raise ValueError(f"checkpoint {str(ckpt_dir / tag)!r} was written by engine 'megatron', whose export "
                             "is not in this version (megatron_ring.training.export_megatron)") from None
        return export_megatron_checkpoint(ckpt_dir, tag, out_dir)
    return export_deepspeed_checkpoint(ckpt_dir, tag, marker, out_dir)


def export_deepspeed_checkpoint(ckpt_dir: Path, tag: str, marker: dict[str, Any], out_dir: Path) -> Path:
    """A DeepSpeed-engine checkpoint of a transformers model -> ``out_dir`` (Note [Which weights an export takes])."""
    import torch
    from transformers import AutoModelForCausalLM, CONFIG_MAPPING

    record = marker.get("transformers")
    if not isinstance(record, dict) or "config" not in record:
        raise ValueError(f"checkpoint {str(ckpt_dir / tag)!r} holds no transformers model (its {COMPLETE} records "
                         "none: a configs/megatron GPT under engine 'deepspeed', or a checkpoint written before "
                         "export existed); export writes the transformers models of megatron_ring.transformers")
    config_dict = dict(record["config"])
    config = CONFIG_MAPPING[config_dict["model_type"]].from_dict(config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = deepspeed_fp32_state_dict(ckpt_dir, tag, [name for name, _ in model.named_parameters()])
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ValueError(f"checkpoint {str(ckpt_dir / tag)!r} does not fit its recorded {type(config).__name__}: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    if record.get("checkpoint") is not None:
        save_tokenizer(record["checkpoint"], out_dir)
    return out_dir


def save_tokenizer(source: dict[str, Any], out_dir: Path) -> None:
    """The tokenizer of the pretrained checkpoint the model started from, saved into ``out_dir``."""
    from megatron_ring.integrations.hf.checkpoint import load_tokenizer, resolve_checkpoint

    cache_dir = Path(source["cache_dir"]) if source.get("cache_dir") else None
    try:
        tokenizer = load_tokenizer(resolve_checkpoint(source["checkpoint"]), gguf_file=source.get("gguf_file"),
                                   cache_dir=cache_dir)
    except (OSError, ValueError) as err:
        raise ValueError(f"the tokenizer of the pretrained checkpoint {source['checkpoint']!r} cannot be read: "
                         f"{err}") from None
    tokenizer.save_pretrained(out_dir)


def deepspeed_fp32_state_dict(ckpt_dir: Path, tag: str, names: list[str]) -> dict[str, Any]:
    """The full fp32 state dict of a DeepSpeed checkpoint at any dp x cp layout and ZeRO stage; ``names``: the
    model's parameters in ``named_parameters()`` order (the order of a stage-0 optimizer's fp32 copies)."""
    import torch
    from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT, PARTITION_COUNT, \
        SINGLE_PARTITION_OF_FP32_GROUPS, ZERO_STAGE
    from deepspeed.utils import zero_to_fp32

    tag_dir = ckpt_dir / tag
    optim_files = sorted(tag_dir.glob("*_optim_states.pt"), key=lambda p: zero_to_fp32.natural_keys(p.name))
    if not optim_files:  # ZeRO stage 0: the module's weights, or the fp32 copies of a bf16 optimizer
        states = torch.load(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
        state = {k: v.float() if v.is_floating_point() else v for k, v in states["module"].items()}
        masters = stage0_masters(states.get("optimizer"))
        if masters is not None:
            if len(masters) != len(names):
                raise ValueError(f"checkpoint {str(tag_dir)!r}: {len(masters)} fp32 master weights for "
                                 f"{len(names)} parameters")
            state.update(zip(names, masters))
        return state
    first = torch.load(optim_files[0], map_location="cpu", weights_only=False)[OPTIMIZER_STATE_DICT]
    if ZERO_STAGE in first:
        return zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir), tag=tag)
    # DeepSpeed's bf16 optimizer at ZeRO stage 0: ZeRO-2's layout, no stage named
    groups = [first[SINGLE_PARTITION_OF_FP32_GROUPS]]
    groups += [torch.load(f, map_location="cpu", weights_only=False)[OPTIMIZER_STATE_DICT]
               [SINGLE_PARTITION_OF_FP32_GROUPS] for f in optim_files[1:]]
    count = first[PARTITION_COUNT]
    count = max(count) if isinstance(count, list) else count
    if count != len(optim_files):
        raise ValueError(f"checkpoint {str(tag_dir)!r} has {len(optim_files)} optimizer files for {count} partitions")
    model_states = zero_to_fp32.parse_model_states(zero_to_fp32.get_model_state_files(str(tag_dir)))
    state = zero_to_fp32._get_fp32_state_dict_from_zero2_checkpoint(count, groups, model_states, False)
    return zero_to_fp32.to_torch_tensor(state)


def stage0_masters(optimizer: Any) -> Optional[list[Any]]:
    """The fp32 master weights, in parameter order, that DeepSpeed's bf16/fp16 optimizer keeps at ZeRO stage 0
    (``fp32_groups``: one tensor per parameter; ``fp32_groups_flat``: one flat tensor per group, which
    needs the shapes and is not written by the optimizers used here); None for a plain fp32 optimizer."""
    if not isinstance(optimizer, dict) or "fp32_groups" not in optimizer:
        if isinstance(optimizer, dict) and "fp32_groups_flat" in optimizer:
            raise ValueError("a fused fp16/bf16 optimizer checkpoint (fp32_groups_flat) cannot be exported yet")
        return None
    return [t.float() for group in optimizer["fp32_groups"] for t in group]


def export_main(argv: Optional[Sequence[str]] = None) -> int:
    """``megatron-ring export CHECKPOINT OUT_DIR``; exit status 2 with one line on bad input."""
    from megatron_ring.runtime.args import usage_error

    parser = argparse.ArgumentParser(prog="megatron-ring export", description="Write a transformers checkpoint "
                                     "(config.json, model.safetensors, the tokenizer) from a training checkpoint "
                                     "of either engine, saved at any layout; offline, in this one process.")
    parser.add_argument("checkpoint", type=Path, help="a training checkpoint.dir (its latest complete step) or a "
                        "step folder")
    parser.add_argument("out_dir", type=Path, help="the transformers checkpoint folder to write (new or empty)")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        out = export_checkpoint(args.checkpoint, args.out_dir)
    except (ValueError, CheckpointError) as err:
        return usage_error("megatron-ring export", err)
    print(f"[megatron_ring] exported {str(args.checkpoint)!r} -> {str(out)!r}", flush=True)
    return 0
