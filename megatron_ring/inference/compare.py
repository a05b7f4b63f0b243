"""``megatron-ring compare``: run the baseline and the ring config of a pair, print them side by side.

Each config runs under a real launcher (the DeepSpeed launcher by default, torchrun on request)
with as many processes as its layout needs, one after the other; the result JSONs are then put in
one table with a ``ring / baseline`` ratio column, and the greedy tokens of both runs compared::

    megatron-ring compare cpu                       # cpu_baseline_tp2_pp2 vs cpu_ring_cp4, 4 CPU processes
    megatron-ring compare cpu-tp2-cp2
    megatron-ring compare paper                     # 16 GPUs
    megatron-ring compare A.json B.json --launcher torchrun
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Sequence

from megatron_ring.config import ConfigError, load_mapping, output_problem
from megatron_ring.runtime.args import usage_error
from megatron_ring.runtime.folder_lock import FolderBusy, owned_folder
from megatron_ring.runtime.job import Interrupted, interruptible, run_job
from megatron_ring.runtime.pool import free_port
from megatron_ring.inference.metrics import format_table
from megatron_ring.integrations.deepspeed.config import split_config
from megatron_ring.config.layout import LayoutConfig
from megatron_ring.config.shipped import find_config
from megatron_ring.inference.main import load_spec
from megatron_ring.inference.schema import ModelSection, load_model_mapping
from megatron_ring.inference.text_check import check_text_prompts

PAIRS: dict[str, tuple[str, str]] = {
    "cpu": ("cpu_baseline_tp2_pp2.json", "cpu_ring_cp4.json"),
    "cpu-tp2-cp2": ("cpu_baseline_tp2_pp2.json", "cpu_ring_tp2_cp2.json"),
    "paper": ("paper_baseline_tp8_pp2.json", "paper_ring_cp16.json"),
    "long-tp2": ("long_sdpa_tp2.json", "long_ring_cp2.json"),
    "long-pp2": ("long_sdpa_pp2.json", "long_ring_cp2.json"),
    "long-gqa-tp2": ("long_gqa_sdpa_tp2.json", "long_gqa_ring_cp2.json"),
    "long-cp4": ("long_sdpa_tp2_pp2.json", "long_ring_cp4.json"),
    "long-tp2-cp2": ("long_sdpa_tp2_pp2.json", "long_ring_tp2_cp2.json"),
    "smollm2-tp2": ("smollm2_autotp_tp2.json", "smollm2_ring_cp2.json"),
    "smollm2-megatron-pp2": ("smollm2_megatron_sdpa_pp2.json", "smollm2_megatron_ring_cp2.json"),
}
"""Pair name -> (baseline, ring) file names of shipped configs (:func:`~megatron_ring.config.shipped.find_config`)."""


def attention_family(config: Path) -> str:
    """``"megatron-local"`` (Megatron's unfused attention) or ``"block"`` (the core's fused block
    kernel: ``attention: sdpa`` or ``ring``, and the toy runner) for a config, before any launch."""
    _, ours = split_config(load_mapping(config), where=f"config {str(config)!r}")
    section = ModelSection.parse((ours or {}).get("model") or {}, where=f"megatron_ring.model of {str(config)!r}")
    if section.runner != "megatron":
        return "block"
    model = load_model_mapping(section, config.parent)
    return "megatron-local" if model.get("attention") == "local" else "block"


def check_same_kernel(baseline: Path, ring: Path) -> None:
    """ConfigError when the two sides would compute attention with different kernels (an unfair pair)."""
    kernels = {path: attention_family(path) for path in (baseline, ring)}
    if kernels[baseline] != kernels[ring]:
        raise ConfigError(
            f"refusing an unfair comparison: {baseline.name} computes attention with {kernels[baseline]!r} and "
            f"{ring.name} with {kernels[ring]!r}; give the baseline 'attention: sdpa' (the ring's fused block "
            "kernel at cp = 1), or pass --allow-kernel-mismatch to measure the kernels too")


def world_size_of(config: Path) -> int:
    """Processes the config's layout needs (checked again, fully, by the run itself)."""
    _, ours = split_config(load_mapping(config), where=f"config {str(config)!r}")
    layout = ours.get("layout") if isinstance(ours, dict) else None
    return LayoutConfig.parse(layout or {}, where=f"megatron_ring.layout of {str(config)!r}").layout().world_size


LAUNCHERS = ("deepspeed", "torchrun")
"""The launchers a job can be started with (``--launcher``)."""


def module_command(module: str, args: Sequence[str], *, nprocs: int, launcher: str) -> list[str]:
    """The command that runs ``python -m module args`` on ``nprocs`` local processes under ``launcher``."""
    if launcher == "deepspeed":
        bindir = Path(sys.executable).parent
        exe = shutil.which("deepspeed", path=str(bindir)) or shutil.which("deepspeed") or "deepspeed"
        return [exe, "--num_gpus", str(nprocs), "--master_port", str(free_port()), "--module", module, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nprocs),
            "--master_port", str(free_port()), "-m", module, *args]


def has_text_prompts(config: Path) -> bool:
    """Whether the config's workload has text prompts (``workload.text``), read without validating it."""
    _, ours = split_config(load_mapping(config), where=f"config {str(config)!r}")
    workload = ours.get("workload") if isinstance(ours, dict) else None
    return isinstance(workload, dict) and workload.get("text") is not None


def launch_command(config: Path, output: Path, *, nprocs: int, launcher: str) -> list[str]:
    """The command that runs ``config`` on ``nprocs`` local processes and writes ``output``."""
    return module_command("megatron_ring.inference.main", ["--deepspeed_config", str(config), "--output", str(output)],
                          nprocs=nprocs, launcher=launcher)


def job_env() -> dict[str, str]:
    """The environment of a launched job: this one, with ``DS_ACCELERATOR=cpu`` on a machine without CUDA."""
    env = dict(os.environ)
    if "DS_ACCELERATOR" not in env:
        import torch

        if not torch.cuda.is_available():
            env["DS_ACCELERATOR"] = "cpu"
    return env


def run_config(config: Path, out_dir: Path, *, launcher: str, name: str | None = None) -> dict:
    """Run one config to completion; return its result (RuntimeError with the log's tail on failure).

    The result and the log are ``out_dir/<name>.json`` and ``.log``, ``name`` the config's stem by default.
    """
    nprocs = world_size_of(config)
    output = out_dir / f"{name or config.stem}.json"
    log = out_dir / f"{name or config.stem}.log"
    output.unlink(missing_ok=True)
    cmd = launch_command(config, output, nprocs=nprocs, launcher=launcher)
    print(f"[compare] {config.name}: {nprocs} processes via {launcher} (log: {log})", flush=True)
    start = time.perf_counter()
    code = run_job(cmd, log=log, env=job_env())
    print(f"[compare] {config.name}: exit {code} after {time.perf_counter() - start:.1f}s", flush=True)
    if code != 0 or not output.is_file():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        raise RuntimeError(f"{config.name} failed (exit {code}); last lines of {log}:\n{tail}")
    return json.loads(output.read_text())


def resolve_pair(names: Sequence[str]) -> tuple[Path, Path]:
    """``[pair]`` or ``[baseline.json, ring.json]`` -> two config paths."""
    if len(names) == 1:
        if names[0] not in PAIRS:
            raise ConfigError(f"unknown pair {names[0]!r}; allowed: {sorted(PAIRS)} or two config paths")
        base, ring = PAIRS[names[0]]
        return find_config(base), find_config(ring)
    if len(names) == 2:
        return find_config(names[0]), find_config(names[1])
    raise ConfigError(f"give one pair name ({sorted(PAIRS)}) or two config paths, got {list(names)}")


def compare_main(argv: Sequence[str] | None = None) -> int:
    """Entry of ``megatron-ring compare``; returns the exit status."""
    parser = argparse.ArgumentParser(prog="megatron-ring compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", nargs="+", metavar="PAIR|CONFIG",
                        help=f"a pair name ({', '.join(sorted(PAIRS))}) or baseline and ring config paths")
    parser.add_argument("--launcher", choices=LAUNCHERS, default="deepspeed")
    parser.add_argument("--out-dir", default="results/compare", help="where results and logs go")
    parser.add_argument("--allow-kernel-mismatch", action="store_true",
                        help="run a pair whose sides use different attention kernels (refused by default)")
    args = parser.parse_args(argv)
    problem = output_problem({"--out-dir": (args.out_dir, True)})
    if problem is not None:
        return usage_error(parser.prog, problem)
    try:
        baseline_cfg, ring_cfg = resolve_pair(args.configs)
        if baseline_cfg.stem == ring_cfg.stem:
            raise ConfigError(f"both configs are named {baseline_cfg.stem!r} ({str(baseline_cfg)!r}, {str(ring_cfg)!r}): "
                              f"the second run's result and log would overwrite the first's in --out-dir; rename one")
        if not args.allow_kernel_mismatch:
            check_same_kernel(baseline_cfg, ring_cfg)
        for config in (baseline_cfg, ring_cfg):  # text prompts the ranks would refuse, refused before any starts
            if has_text_prompts(config):
                check_text_prompts(load_spec(config, world_size=world_size_of(config)))
        with owned_folder(Path(args.out_dir), field="--out-dir") as out_dir:  # Note [Folder locks]
            for config in (baseline_cfg, ring_cfg):  # a run stopped half-way must not pair with an old result
                (out_dir / f"{config.stem}.json").unlink(missing_ok=True)
            with interruptible():
                results = [run_config(c, out_dir, launcher=args.launcher) for c in (baseline_cfg, ring_cfg)]
    except (ConfigError, FolderBusy) as err:
        return usage_error(parser.prog, err)
    except RuntimeError as err:
        print(f"[compare] {err}", file=sys.stderr)
        return 1
    except Interrupted as stop:
        print(f"[compare] {stop}: the running job was stopped; results of unfinished runs are not written",
              file=sys.stderr)
        return stop.exit_code
    print()
    print(format_table(results, ratios=True))
    kernels = [r["attention_kernel"] for r in results]
    print(f"\nattention kernel: {results[0]['name']} {kernels[0]}, {results[1]['name']} {kernels[1]}")
    if kernels[0] != kernels[1]:
        print("WARNING: the two sides computed attention with different kernels; the ratios above measure the "
              "kernels as much as the parallelism", file=sys.stderr)
    same = results[0]["generated"] == results[1]["generated"]
    print(f"\ngreedy tokens identical: {'yes' if same else 'NO'} "
          f"({results[0]['workload']['batch']} sequences x {results[0]['workload']['new_tokens']} tokens)")
    if "generated_text" in results[0] and "generated_text" in results[1]:
        print(format_answers(results))
    return 0


def format_answers(results: list[dict]) -> str:
    """Both sides' answers to each text prompt, one after the other, and whether they are identical."""
    lines = []
    names = [r["name"] for r in results]
    width = max(len(n) for n in names)
    for row, prompt in enumerate(results[0]["prompts"]):
        texts = [r["generated_text"][row] for r in results]
        lines.append(f"\nprompt {row}: {prompt['source']} ({prompt['document_tokens_kept']} of "
                     f"{prompt['document_tokens']} document tokens, {prompt['padding']} padding)")
        if prompt["question"]:
            lines.append(f"  question: {prompt['question']}")
        for name, text in zip(names, texts):
            body = text.strip().replace("\n", "\n  " + " " * (width + 2))
            lines.append(f"  {name:<{width}}: {body}")
        lines.append(f"  answers identical: {'yes' if texts[0] == texts[1] else 'NO'}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(compare_main())
