"""Ring attention demo: ``torchrun --nproc_per_node 4 launch/ring_demo.py`` (gloo on CPU, nccl on GPUs)."""
import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_ring.demo import ring_demo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--heads-kv", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("WORLD_SIZE", 1))))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(minutes=5))
    device = torch.device("cuda") if cuda else torch.device("cpu")
    row = ring_demo(args.seq_len, args.heads, args.heads_kv, args.head_dim, getattr(torch, args.dtype), device)
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        print(f"ring attention, causal zigzag, L={args.seq_len}, heads {args.heads}/{args.heads_kv}, "
              f"head_dim {args.head_dim}, {args.dtype}, cp={len(rows)}")
        print(f"{'rank':>4} {'tokens':>7} {'rel err vs fp64':>16} {'fwd+bwd ms':>11} {'sent MiB':>9}")
        for r in rows:
            print(f"{r['rank']:>4} {r['tokens']:>7} {r['rel_err']:>16.2e} {r['fwd_bwd_ms']:>11.1f} {r['sent_MiB']:>9.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
