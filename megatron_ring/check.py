"""``megatron-ring check CONFIG [CONFIG ...]``: validate configs without starting a rank.

Every config kind the project ships goes through the same validation its ranks run first:

* a DeepSpeed JSON with a ``megatron_ring`` section that trains (``steps``): ``load_train_spec``
  (both engines, the ``transformers`` entry, data and held-out files through the tokenizer);
* a training YAML with Megatron-LM's names (``train_iters``, ``tensor_model_parallel_size``, ...):
  the same ``load_train_spec`` after its translation (:mod:`megatron_ring.training.megatron_args`);
* a DeepSpeed JSON with a ``megatron_ring`` section that serves (``workload``): the inference
  ``load_spec`` (runner, model, workload, prompts); with a ``serve`` section, ``megatron-ring serve``'s
  checks (serving/serve_main.py);
* a ``configs/megatron`` YAML: the GPT config (a model naming a checkpoint: its config read and
  converted, its weights not);
* a DeepSpeed JSON without our section, for the transformers ``Trainer`` (``--deepspeed``): DeepSpeed's
  own parser and the ZeRO-3 rules, ``"auto"`` entries left to the Trainer.

The world size is the config's own layout (tp · pp · cp · dp; a Megatron-LM-style YAML: tp · pp · cp,
Megatron's data-parallel size being what the world leaves) unless ``--world`` says how many
processes would be launched. Exit 0 with one line per config, or 2 with every problem of the first
bad one, naming the field, its value and what is allowed.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_ring.config import ConfigError, load_mapping
from megatron_ring.runtime.args import positive_int, usage_error

SECTION = "megatron_ring"


DEEPSPEED_KEYS = ("zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu", "optimizer", "bf16",
                  "fp16", "gradient_accumulation_steps")
"""Top-level keys of which one marks a mapping without our section as a DeepSpeed training config."""


def config_kind(raw: Any, path: Path) -> str:
    """``"training"``, ``"inference"``, ``"model"`` or ``"trainer"`` (a DeepSpeed config for the transformers
    Trainer) from the mapping's keys; ConfigError when none fits.
    A YAML with Megatron-LM's training names (:mod:`megatron_ring.training.megatron_args`) is ``"training"``."""
    from megatron_ring.training.megatron_args import is_megatron_args

    if is_megatron_args(raw, path):
        return "training"
    if isinstance(raw, dict) and isinstance(raw.get(SECTION), dict):
        ours = raw[SECTION]
        if "steps" in ours or "seq_len" in ours or "engine" in ours:
            return "training"
        if "workload" in ours or "model" in ours:
            return "inference"
    if isinstance(raw, dict) and ("model" in raw or "checkpoint" in raw) and path.suffix in (".yaml", ".yml"):
        return "model"
    if isinstance(raw, dict) and SECTION not in raw and any(key in raw for key in DEEPSPEED_KEYS):
        return "trainer"
    raise ConfigError(f"{str(path)!r}: not a config this project reads (a DeepSpeed JSON with a '{SECTION}' section "
                      "that trains (steps) or serves (workload), a DeepSpeed JSON for the transformers Trainer, or a "
                      "configs/megatron model YAML)")


def layout_world(raw: dict[str, Any]) -> int:
    """The product of the section's layout sizes (1 for an axis not given); of a Megatron-LM-style YAML,
    tp * pp * cp (data-parallel size 1)."""
    if SECTION not in raw:
        keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size")
        sizes = [raw.get(key, 1) for key in keys]
    else:
        layout = raw[SECTION].get("layout") or {}
        sizes = [layout.get(axis, 1) for axis in ("tp", "pp", "cp", "dp")]
    return math.prod(s for s in sizes if isinstance(s, int) and s > 0)


def check_one(path: Path, world: Optional[int]) -> str:
    """Validate ``path``; a one-line summary, or ConfigError."""
    raw = load_mapping(path)
    kind = config_kind(raw, path)
    if kind == "model":
        from megatron_ring.config.gpt import GPTConfig

        if "checkpoint" in raw:
            from megatron_ring.training.pretrained import pretrained_gpt_config

            cfg = pretrained_gpt_config(raw, seq_len=None, where=f"model {str(path)!r}")[0]
        else:
            cfg = GPTConfig.parse(raw, where=f"model {str(path)!r}")
        m = cfg.model
        return (f"model: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads "
                f"({m.num_query_groups or m.num_attention_heads} K/V groups), attention {cfg.attention}, {cfg.dtype}")
    if kind == "trainer":
        from megatron_ring.integrations.deepspeed.config import check_trainer_config

        stage = check_trainer_config(raw, where=f"config {str(path)!r}")
        return f"DeepSpeed config for the transformers Trainer, ZeRO stage {stage} ('auto' entries: the Trainer's)"
    size = world or layout_world(raw)
    if kind == "training":
        from megatron_ring.training.schema import load_train_spec

        spec = load_train_spec(path, world_size=size)
        return (f"training ({spec.train.engine} engine), layout {spec.layout.describe()} on {size} processes, "
                f"seq_len {spec.train.seq_len}, {spec.train.steps} steps, global batch {spec.global_batch}")
    ours = raw.get("megatron_ring")
    if isinstance(ours, dict) and ours.get("serve") is not None:
        from megatron_ring.serving.serve_main import serve_spec

        spec, serve = serve_spec(str(path), size)
        return (f"serve ({spec.ring.model.runner} runner), layout {spec.layout.describe()} on {size} processes, "
                f"http://{serve.host}:{serve.port}/v1, cache budget {serve.cache_budget_tokens} tokens")
    from megatron_ring.inference.main import load_spec
    from megatron_ring.inference.text_check import check_text_prompts

    spec = load_spec(path, world_size=size)
    check_text_prompts(spec)
    return f"inference ({spec.ring.model.runner} runner), layout {spec.layout.describe()} on {size} processes"


def check_main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-ring check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", nargs="+", type=Path, help="training or inference JSON, a DeepSpeed JSON for the "
                        "transformers Trainer, a training YAML with Megatron-LM's names, or a configs/megatron "
                        "model YAML")
    parser.add_argument("--world", type=positive_int, default=None,
                        help="processes the launcher would start (default: the config's layout)")
    args = parser.parse_args(argv)
    for path in args.configs:
        try:
            print(f"{path}: OK, {check_one(path, args.world)}", flush=True)
        except (ConfigError, ValueError, OSError) as err:
            return usage_error(parser.prog, err if isinstance(err, ConfigError) else f"{path}: {err}")
    return 0


if __name__ == "__main__":
    sys.exit(check_main())
