"""Prefill + generate (greedy, beam search or sampling) of a Hugging Face causal LM with ring attention over CP ranks.

Every rank loads the same model and prompt; the prompt is sharded (zigzag) over the CP group, the
KV cache stays sharded, and every rank ends with the same tokens. With a DeepSpeed config whose
``tensor_parallel.tp_size`` is N, AutoTP splits the model over N ranks and CP uses the rest::

    python -m megatron_ring.testing.tiny_hf llama /tmp/tiny-llama      # a tiny random model, nothing downloaded
    torchrun --nproc-per-node 2 examples/hf_ring_generate.py --model /tmp/tiny-llama --check
    DS_ACCELERATOR=cpu deepspeed --num_gpus 4 examples/hf_ring_generate.py --model /tmp/tiny-llama \\
        --deepspeed_config configs/deepspeed/cpu_ring_tp2_cp2.json --check

``--num-beams N`` runs beam search, ``--sample`` seeded sampling (the same ``--seed`` on every rank);
``--check`` compares with single-process eager generation on rank 0.
"""
from __future__ import annotations

import argparse
import json
from datetime import timedelta

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

from megatron_ring import ParallelLayout, init_parallel
from megatron_ring.hf import init_autotp, ring_generate
from megatron_ring.integrations.deepspeed.config import split_config
from megatron_ring.integrations.deepspeed.process_group import init_distributed


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="local Hugging Face model directory")
    parser.add_argument("--deepspeed_config", help="DeepSpeed inference JSON; its tensor_parallel.tp_size sets TP")
    parser.add_argument("--prompt", nargs="+", default=["Ring attention splits the sequence,", "so each rank"])
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--num-beams", type=int, default=1, help="beam search with this many beams")
    parser.add_argument("--sample", action="store_true", help="sampling (top_k=50, top_p=0.95)")
    parser.add_argument("--seed", type=int, default=0, help="the sampling seed, the same on every rank")
    parser.add_argument("--check", action="store_true", help="compare with single-process eager on rank 0")
    parser.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    device, _ = init_distributed(timeout=timedelta(minutes=5))
    rank, world = dist.get_rank(), dist.get_world_size()

    ds_config = None
    if args.deepspeed_config:
        with open(args.deepspeed_config) as f:
            raw = json.load(f)
        ds_config = split_config(raw)[0] if "megatron_ring" in raw else raw
    tp = (ds_config or {}).get("tensor_parallel", {}).get("tp_size", 1)
    groups = init_parallel(ParallelLayout(tp=tp, cp=world // tp))

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="ring").to(device).eval()
    if ds_config is not None:
        model = init_autotp(model, groups.tp, ds_config)
    batch = tokenizer(args.prompt, return_tensors="pt", padding=True).to(device)
    mode = dict(max_new_tokens=args.max_new_tokens, num_beams=args.num_beams, do_sample=args.sample,
                **(dict(top_k=50, top_p=0.95) if args.sample else {}))
    torch.manual_seed(args.seed)
    tokens = ring_generate(model, batch.input_ids, batch.attention_mask, group=groups.cp, **mode)

    if rank == 0:
        prompt_len = batch.input_ids.shape[1]
        print(f"tp={tp} x cp={world // tp}: {tokenizer.batch_decode(tokens[:, prompt_len:])}")
        if args.check:
            ref = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="eager").to(device).eval()
            torch.manual_seed(args.seed)
            expected = ref.generate(**batch, **mode)
            print("check:", "same tokens as single-process eager" if torch.equal(tokens, expected) else "MISMATCH")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
