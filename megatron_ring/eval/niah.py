"""``megatron-ring niah``: needle in a haystack over context lengths x depths, for any inference config.

::

    megatron-ring niah configs/deepspeed/smollm2_ring_cp2.json --lengths 1024 2048 4096 \\
        --depths 0 0.25 0.5 0.75 1 --out results/niah_cp2 --compare-to results/niah_cp1/niah.json

Each cell is one question: a fact (``The special magic number for the silver harbor is 614207.``)
hidden at ``depth`` of the repository's shipped text (``data/corpus``), exactly ``length`` tokens
through the checkpoint's tokenizer and chat template (:mod:`megatron_ring.eval.needle_prompts`),
answered greedily by the config's runner (hf or megatron, any layout the config has). A cell scores 1
when the answer contains the fact's 6-digit value. Everything is checked here before any rank starts
(the config as ``megatron-ring infer`` checks it, with its workload replaced by the grid's; every
length against the model's window, the zigzag's ``2*cp`` and the needle's room; the output folder);
then the grid runs as ONE launched job (``megatron_ring.eval.niah_rank``: the model loads once, the
runner is built for the longest cell). ``OUT/niah.json`` holds every cell (length, depth, tokens,
score, answer, expected value, seconds), ``OUT/heatmap.png`` the classic heatmap (rows = depth,
columns = length, colour = score), ``OUT/niah.log`` the job's output. ``--compare-to`` checks the
result against another run's ``niah.json`` cell by cell (exit 1 when they differ): cp 2 against cp 1.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_ring.config import ConfigError, load_mapping, output_problem
from megatron_ring.config.checkpoint import CheckpointSource
from megatron_ring.config.layout import LayoutConfig
from megatron_ring.config.shipped import find_config
from megatron_ring.datasets.files import corpus_files
from megatron_ring.eval.needle_prompts import MIN_HAYSTACK, NeedleCell, fixed_tokens, needle_grid
from megatron_ring.eval.niah_report import comparison_text, format_table, same_grid_problem
from megatron_ring.inference.compare import LAUNCHERS, job_env, module_command
from megatron_ring.inference.main import load_spec
from megatron_ring.inference.schema import InferenceSpec, runner_module
from megatron_ring.integrations.deepspeed.config import SECTION, split_config
from megatron_ring.runtime.args import int_at_least, usage_error
from megatron_ring.runtime.folder_lock import FolderBusy, owned_folder
from megatron_ring.runtime.job import Interrupted, interruptible, run_job

PROG = "megatron-ring niah"
PROMPTS = "niah_prompts.json"
"""The grid and its prompt ids, written for the ranks (removed after a successful run)."""
TEXT_SUFFIXES = (".txt", ".md")


def depth(text: str) -> float:
    """An argparse type: a needle depth, a number in [0, 1] (0: the document's start, 1: its end)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a depth in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a depth in [0, 1] (0: the document's start, 1: its end), "
                                         f"got {value}")
    return value


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", metavar="CONFIG", help="an inference config (configs/deepspeed/*.json with a "
                        "megatron_ring section; a shipped one by name): its model and layout answer")
    parser.add_argument("--lengths", type=int_at_least(2), nargs="+", default=[1024, 2048, 4096],
                        help="context lengths in tokens, the whole prompt (template and question included)")
    parser.add_argument("--depths", type=depth, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0],
                        help="needle depths in [0, 1]: the share of the haystack before the needle")
    parser.add_argument("--new-tokens", type=int_at_least(2), default=32, help="greedy tokens of each answer")
    parser.add_argument("--texts", nargs="+", default=["data/corpus"],
                        help="text files or folders (.txt, .md) of the haystack")
    parser.add_argument("--seed", type=int, default=0, help="draws each cell's fact and haystack")
    parser.add_argument("--no-chat-template", dest="chat_template", action="store_false",
                        help="plain text prompts (default: the tokenizer's chat template, one user message)")
    parser.add_argument("--launcher", choices=LAUNCHERS, default="deepspeed")
    parser.add_argument("--out", default="results/niah", help="folder of niah.json, heatmap.png and niah.log")
    parser.add_argument("--compare-to", default=None, metavar="NIAH_JSON",
                        help="another run's niah.json (e.g. cp 1): the cells must be identical (exit 1 otherwise)")
    return parser.parse_args(argv)


@dataclass
class NiahPlan:
    """A checked run: the config, its validated spec for the longest cell, the cells and the grid record."""

    config: Path
    spec: InferenceSpec
    cells: list[NeedleCell]
    grid: dict[str, Any]
    workload: dict[str, Any]


def grid_workload(lengths: Sequence[int], new_tokens: int) -> dict[str, Any]:
    """The workload that replaces the config's: one row, the longest cell, ``new_tokens``, no text."""
    return {"batch": 1, "prompt_len": max(lengths), "new_tokens": new_tokens, "warmup": 0, "repeats": 1, "text": None}


def inference_layout(config: Path) -> LayoutConfig:
    """The layout of an inference config; ConfigError saying it is not one when it has no ``megatron_ring``
    section with ``model``, ``layout`` and ``workload``."""
    _, ours = split_config(load_mapping(config), where=f"config {str(config)!r}")
    missing = [key for key in ("model", "layout", "workload") if not isinstance(ours, dict) or key not in ours]
    if missing:
        raise ConfigError(f"CONFIG {str(config)!r} is not an inference config: its {SECTION} section has no "
                          f"{', '.join(missing)}; allowed: a config of megatron-ring infer (configs/deepspeed/*.json "
                          "with model, layout and workload)")
    return LayoutConfig.parse(ours["layout"], where=f"{SECTION}.layout of {str(config)!r}")


def window_of(spec: InferenceSpec) -> tuple[Optional[int], str]:
    """(the model's window in tokens, the field it comes from); None when the model names none."""
    summary = spec.model_summary or {}
    if summary.get("max_position_embeddings") is not None:
        return int(summary["max_position_embeddings"]), "the checkpoint's max_position_embeddings"
    if summary.get("seq_length") is not None:
        return int(summary["seq_length"]), "the megatron model's seq_length"
    return None, ""


def check_lengths(lengths: Sequence[int], *, cp: int, new_tokens: int, window: Optional[int], source: str) -> None:
    """ConfigError naming ``--lengths`` for a length the zigzag cannot split or the window cannot hold."""
    problems = []
    for length in lengths:
        if length % (2 * cp):
            problems.append(f"--lengths {length} is not divisible by 2*cp = {2 * cp} (zigzag sharding over cp {cp}); "
                            f"allowed: multiples of {2 * cp}")
        if window is not None and length + new_tokens - 1 > window:
            problems.append(f"--lengths {length}: length + --new-tokens - 1 = {length + new_tokens - 1} exceeds "
                            f"{source} = {window}; allowed: lengths <= {window - new_tokens + 1}")
    if len(set(lengths)) != len(lengths):
        problems.append(f"--lengths {list(lengths)} repeats a length; give each once")
    if problems:
        raise ConfigError("; ".join(problems))


def load_tokenizer_of(spec: InferenceSpec) -> Any:
    """The tokenizer of the config's checkpoint (offline); ConfigError when the model has none."""
    module = runner_module(spec.ring.model.runner)
    takes_text = getattr(module, "takes_text", None)
    if not (takes_text and takes_text(spec.model)):
        raise ConfigError(f"{SECTION}.model (runner {spec.ring.model.runner!r}) serves random weights without a "
                          "tokenizer; a needle needs text: give a checkpoint (the hf runner, or the megatron runner "
                          "with checkpoint)")
    from megatron_ring.integrations.hf.checkpoint import load_tokenizer, resolve_checkpoint

    source = CheckpointSource(**{key: spec.model[key] for key in ("checkpoint", "gguf_file", "cache_dir")
                                 if spec.model.get(key) is not None})
    try:
        return load_tokenizer(resolve_checkpoint(source.checkpoint), gguf_file=source.gguf_file,
                              cache_dir=Path(source.cache_dir) if source.cache_dir else None)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{SECTION}.model checkpoint = {source.checkpoint!r}: its tokenizer cannot be loaded "
                          f"({err})") from None


def plan_run(args: argparse.Namespace) -> NiahPlan:
    """Everything checked and every prompt built, before any rank starts (ConfigError/ValueError naming the
    flag or field)."""
    config = find_config(args.config)
    layout = inference_layout(config).layout()
    # The config as `infer` checks it, at the shortest length the layout splits: the model against the layout,
    # dtype and runner, and its window (a length over it is named by --lengths below, not by the workload).
    result = str(Path(args.out) / "niah.json")  # not the config's output: this run writes niah.json
    probe = load_spec(config, world_size=layout.world_size, output=result,
                      workload=grid_workload([2 * layout.cp], args.new_tokens))
    tokenizer = load_tokenizer_of(probe)
    window, source = window_of(probe)
    check_lengths(args.lengths, cp=layout.cp, new_tokens=args.new_tokens, window=window, source=source)
    if len(set(args.depths)) != len(args.depths):
        raise ConfigError(f"--depths {args.depths} repeats a depth; give each once")
    workload = grid_workload(args.lengths, args.new_tokens)
    spec = load_spec(config, world_size=layout.world_size, output=result, workload=workload)
    if args.chat_template and not getattr(tokenizer, "chat_template", None):
        raise ConfigError("the checkpoint's tokenizer has no chat template; pass --no-chat-template")
    files = corpus_files(args.texts, TEXT_SUFFIXES, field="--texts")
    texts = []
    for file in files:
        try:
            texts.append(file.read_text(encoding="utf-8"))
        except UnicodeDecodeError as err:
            raise ConfigError(f"--texts: {str(file)!r} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    short = [n for n in args.lengths if n < fixed_tokens(tokenizer, chat=args.chat_template) + MIN_HAYSTACK]
    if short:
        need = fixed_tokens(tokenizer, chat=args.chat_template) + MIN_HAYSTACK
        raise ConfigError(f"--lengths {short}: too short for a needle; the chat template, question and needle take "
                          f"about {need - MIN_HAYSTACK} tokens and a haystack at least {MIN_HAYSTACK}; allowed: "
                          f"lengths >= {need}")
    cells = needle_grid(texts, tokenizer, lengths=args.lengths, depths=args.depths, seed=args.seed,
                        chat=args.chat_template)
    grid = {"lengths": list(args.lengths), "depths": list(args.depths), "new_tokens": args.new_tokens,
            "seed": args.seed, "texts": [str(f) for f in files], "chat_template": args.chat_template}
    return NiahPlan(config, spec, cells, grid, workload)


def read_other(path: Optional[str], grid: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The result ``--compare-to`` names, checked to be a niah.json of the same grid (ConfigError otherwise)."""
    if path is None:
        return None
    try:
        other = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"--compare-to {path!r}: cannot be read as JSON ({err})") from None
    problem = same_grid_problem(other, grid, f"--compare-to {path!r}") if isinstance(other, dict) else \
        f"--compare-to {path!r}: not a result of megatron-ring niah"
    if problem:
        raise ConfigError(problem)
    return other


def run_plan(plan: NiahPlan, out: Path, launcher: str) -> dict[str, Any]:
    """Launch the grid as one job writing into ``out``; its niah.json (RuntimeError with the log's tail)."""
    for name in ("niah.json", "heatmap.png"):  # a stopped run must not leave an old result behind
        (out / name).unlink(missing_ok=True)
    prompts = out / PROMPTS
    prompts.write_text(json.dumps({"grid": plan.grid, "workload": plan.workload,
                                   "cells": [cell.record() for cell in plan.cells]}))
    layout = plan.spec.layout
    log = out / "niah.log"
    cmd = module_command("megatron_ring.eval.niah_rank", ["--deepspeed_config", str(plan.config),
                         "--prompts", str(prompts)], nprocs=layout.world_size, launcher=launcher)
    print(f"[niah] {plan.config.name} ({layout.describe()}): {len(plan.cells)} cells, {layout.world_size} "
          f"process(es) via {launcher} (log: {log})", flush=True)
    start = time.perf_counter()
    code = run_job(cmd, log=log, env=job_env())
    print(f"[niah] exit {code} after {time.perf_counter() - start:.1f} s", flush=True)
    result_file = out / "niah.json"
    if code != 0 or not result_file.is_file():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        raise RuntimeError(f"the job failed (exit {code}); last lines of {log}:\n{tail}")
    prompts.unlink()
    return json.loads(result_file.read_text())


def niah_main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry of ``megatron-ring niah``; 0, 1 (a failed job or cells that differ from --compare-to), 2 (bad input)."""
    args = parse_args(argv)
    problem = output_problem({"--out": (args.out, True)})
    if problem is not None:
        return usage_error(PROG, problem)
    try:
        plan = plan_run(args)
        other = read_other(args.compare_to, plan.grid)
        with owned_folder(Path(args.out), field="--out") as out, interruptible():  # Note [Folder locks]
            result = run_plan(plan, out, args.launcher)
    except (ConfigError, FolderBusy, ValueError) as err:
        return usage_error(PROG, err)
    except RuntimeError as err:
        print(f"[niah] {err}", file=sys.stderr)
        return 1
    except Interrupted as stop:
        print(f"[niah] {stop}: the job was stopped; no result written", file=sys.stderr)
        return stop.exit_code
    print(format_table(result))
    print(f"\n[niah] {Path(args.out) / 'niah.json'}, {Path(args.out) / 'heatmap.png'}")
    if other is not None:
        same, text = comparison_text(result, other, args.compare_to)
        print(f"[niah] {text}")
        return 0 if same else 1
    return 0


if __name__ == "__main__":
    sys.exit(niah_main())
