"""``megatron-ring plan <config>``: the cost model (:mod:`megatron_ring.perf.planner.cost_model`) on a config.

It evaluates the job's own layout and the alternative at the same world size (TP x PP baseline
<-> ring + sequence parallelism, RA+SP) on a hardware profile and prints one table per layout
plus the findings that matter: does the KV cache fit, is the ring step compute- or
communication-bound, what fits.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from megatron_ring.runtime.args import non_negative_int, positive_int, usage_error
from megatron_ring.config.layout import LayoutConfig
from megatron_ring.config.strict import ConfigError, load_mapping, output_problem
from megatron_ring.parallel.layout import ParallelLayout
from megatron_ring.perf.planner import plan_table
from megatron_ring.perf.planner.cost_model import Planner
from megatron_ring.perf.planner.hardware import DEFAULT_PROFILE, DTYPE_BYTES, HardwareProfile, profile_names
from megatron_ring.perf.planner.inputs import CP_COMMS, ModelDims, PlanInput, Workload, alternative_layout
from megatron_ring.perf.planner.measured import compare_measured


def _gpt_model(m: Any) -> ModelDims:
    """ModelDims from a :class:`megatron_ring.config.gpt.GPTModelConfig`."""
    return ModelDims(num_layers=m.num_layers, hidden_size=m.hidden_size, num_heads=m.num_attention_heads,
                     ffn_hidden_size=m.ffn_hidden_size, num_kv_heads=m.query_groups, head_dim=m.kv_channels,
                     vocab_size=m.vocab_size, tie_embeddings=m.tie_embeddings, gated_mlp=m.activation == "swiglu")


def load_plan_input(path: str | Path, *, batch: int | None = None, prompt_len: int | None = None,
                    new_tokens: int | None = None, micro_batch: int | None = None) -> PlanInput:
    """A :class:`PlanInput` from a ``configs/megatron`` YAML or a DeepSpeed JSON with a ``megatron_ring`` section.

    Megatron configs carry no workload: ``batch`` defaults to 1 and ``prompt_len`` to the model's
    ``seq_length``. Keyword arguments override the file's workload.
    """
    from megatron_ring.inference.runners.checkpoint import gpt_config

    path = Path(path)
    data = load_mapping(path)
    if "megatron_ring" in data:
        section = data["megatron_ring"]
        for key in ("model", "layout", "workload"):
            if not isinstance(section.get(key), dict):
                raise ConfigError(f"{path}: megatron_ring.{key} must be a mapping, got {section.get(key)!r}")
        model_cfg = section["model"].get("config")
        if isinstance(model_cfg, str):
            model_path = Path(model_cfg)
            if not model_path.is_file():
                model_path = path.parent / model_cfg
            gpt = gpt_config(load_mapping(model_path), where=f"config {str(model_path)!r}")
        elif isinstance(model_cfg, dict):
            gpt = gpt_config(model_cfg, where=f"{path}: megatron_ring.model.config")
        else:
            raise ConfigError(f"{path}: megatron_ring.model.config must be a path or a mapping, got {model_cfg!r}")
        layout = LayoutConfig.parse(section["layout"], where=f"{path}: megatron_ring.layout").layout()
        wl = section["workload"]
        file_workload = {"batch": wl.get("batch"), "prompt_len": wl.get("prompt_len"),
                         "new_tokens": wl.get("new_tokens", 1)}
        dtype = str(data.get("dtype", gpt.dtype)).replace("bfloat16", "bf16").replace("float16", "fp16")
        name = path.stem
    else:
        gpt = gpt_config(data, where=f"config {str(path)!r}")
        layout = gpt.parallel.layout()
        file_workload = {"batch": 1, "prompt_len": gpt.model.seq_length, "new_tokens": 1}
        dtype = gpt.dtype
        name = gpt.name
    overrides = {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens, "micro_batch": micro_batch}
    workload = Workload(**{**file_workload, **{k: v for k, v in overrides.items() if v is not None}})
    return PlanInput(name=name, model=_gpt_model(gpt.model), layout=layout, workload=workload, dtype=dtype)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="megatron-ring plan", description=__doc__.split("\n")[0].strip("`"))
    ap.add_argument("config", nargs="?", help="configs/megatron/*.yaml or a DeepSpeed JSON with a megatron_ring "
                                              "section; omit to describe the model with flags")
    ap.add_argument("--hardware", default=DEFAULT_PROFILE,
                    help=f"bundled profile {profile_names()} or a JSON path (default {DEFAULT_PROFILE})")
    g = ap.add_argument_group("model (without a config)")
    g.add_argument("--layers", type=positive_int)
    g.add_argument("--hidden", type=positive_int)
    g.add_argument("--heads", type=positive_int)
    g.add_argument("--kv-heads", type=non_negative_int, default=0, help="K/V heads (default 0 = --heads)")
    g.add_argument("--head-dim", type=non_negative_int, default=0, help="default 0 = hidden / heads")
    g.add_argument("--ffn", type=positive_int)
    g.add_argument("--gated-mlp", action="store_true")
    g.add_argument("--vocab", type=non_negative_int, default=0, help="default 0 leaves the embeddings out")
    g.add_argument("--dtype", choices=sorted(DTYPE_BYTES))
    g = ap.add_argument_group("layout and workload (override the config)")
    for axis in LayoutConfig.model_fields:
        g.add_argument(f"--{axis}", type=positive_int)
    g.add_argument("--batch", type=positive_int)
    g.add_argument("--prompt-len", type=positive_int)
    g.add_argument("--new-tokens", type=positive_int)
    g.add_argument("--micro-batch", type=positive_int)
    g.add_argument("--cp-comm", choices=list(CP_COMMS), default="p2p",
                   help="the CP comm the TTFT uses; every comm's attention time is printed beside it")
    g.add_argument("--non-causal", action="store_true", help="bidirectional attention (default causal)")
    ap.add_argument("--no-alternative", action="store_true", help="plan only the given layout")
    ap.add_argument("--measured", help="a bench attention JSON: put its measurements beside the predictions")
    ap.add_argument("--json", dest="json_out", help="write the predictions to this JSON file")
    ap.add_argument("--markdown", help="write the table and findings as Markdown to this file")
    ap.add_argument("--comm-figure", help="draw each CP comm's predicted attention time against L to this PNG")
    return ap


def _input_from_args(args: argparse.Namespace) -> PlanInput:
    if args.config:
        base = load_plan_input(args.config, batch=args.batch, prompt_len=args.prompt_len,
                               new_tokens=args.new_tokens, micro_batch=args.micro_batch)
    else:
        missing = [f"--{n}" for n in ("layers", "hidden", "heads", "ffn", "batch", "prompt_len")
                   if getattr(args, n) is None]
        if missing:
            raise ValueError(f"without a config file, give {', '.join(m.replace('_', '-') for m in missing)}")
        model = ModelDims(num_layers=args.layers, hidden_size=args.hidden, num_heads=args.heads,
                          ffn_hidden_size=args.ffn, num_kv_heads=args.kv_heads, head_dim=args.head_dim,
                          gated_mlp=args.gated_mlp, vocab_size=args.vocab)
        workload = Workload(batch=args.batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens or 1,
                            micro_batch=args.micro_batch or 1)
        base = PlanInput(name="flags", model=model, layout=ParallelLayout(), workload=workload)
    sizes = {k: v if getattr(args, k) is None else getattr(args, k) for k, v in base.layout.sizes().items()}
    return replace(base, layout=LayoutConfig.parse(sizes, where="the layout flags").layout(), dtype=args.dtype or base.dtype,
                   causal=not args.non_causal, cp_comm=args.cp_comm)


def _read_measured(path: str) -> dict[str, Any]:
    """The ``--measured`` bench JSON (ConfigError naming the file when it cannot be read)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"--measured {path!r}: {err}") from None


def plan_main(argv: list[str] | None = None) -> int:
    """``megatron-ring plan``: print (and optionally write) the predictions; 0 on success, 2 on bad input."""
    parser = _parser()
    args = parser.parse_args(argv)
    problem = output_problem({"--json": (args.json_out, False), "--markdown": (args.markdown, False)})
    if problem is not None:
        return usage_error(parser.prog, problem)
    try:
        hw = HardwareProfile.load(args.hardware)
        main = _input_from_args(args)
        inputs = [main]
        measured = _read_measured(args.measured) if args.measured else None
    except ValueError as err:  # ConfigError included
        return usage_error(parser.prog, err)
    if not args.no_alternative and main.layout.tp * main.layout.pp * main.layout.cp > 1:
        try:
            inputs.append(replace(main, name=f"{main.name} (alternative)",
                                  layout=alternative_layout(main.layout, hw)))
        except ValueError as err:
            print(f"no alternative layout: {err}")
    try:
        preds = [Planner(hw).predict(p) for p in inputs]
    except ValueError as err:  # e.g. a --dtype the profile has no numbers for
        return usage_error(parser.prog, err)
    plan_table.print_plan(inputs, preds, hw)
    out: dict[str, Any] = {"hardware": hw.model_dump(), "plans": [asdict(x) for x in preds]}
    if measured is not None:
        rows = compare_measured(measured, hw)
        plan_table.print_comparison(rows, hw.name)
        out["measured_vs_predicted"] = rows
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(out, indent=2))
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(plan_table.plan_markdown(preds, out.get("measured_vs_predicted")))
    if args.comm_figure:
        from megatron_ring.perf.planner.comm_figure import draw_comm_figure

        print(f"wrote {draw_comm_figure(Planner(hw), main, args.comm_figure)}")
    return 0
