"""The prepared device check: every GPU item of ../shared/gpu-checklist.md in one command.

    python -m megatron_ring.perf.bench.device_check --out results/gpu        # on the lent GPU (scripts/gpu_check.sh)
    python -m megatron_ring.perf.bench.device_check --out /tmp/x --cpu-dry-run   # the same code, tiny, on CPU (CI)

Checks, in the checklist's order (device_checks.py, device_ring.py): the block kernels vs float64
(``kernels``), the block kernel vs SDPA (``block_vs_sdpa``), one rank's ring with the transfers
taken out (``decomposition``), decode bandwidth (``decode``), masked calls (``masked``), and two
ranks over NCCL on the one GPU (``two_rank_ring``). Megatron on the GPU and the planner's
calibration are separate commands (``megatron-ring calibrate``; the Megatron tests), listed in
scripts/gpu_check.sh. A check that raises gives one failed row and the others still run. Writes
``device_check.json`` (rows, versions, sizes) and ``device_check.md`` under ``--out`` and prints
the table.
"""
from __future__ import annotations

import argparse
import datetime
import platform
import sys
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from megatron_ring.perf.bench import device_checks as checks
from megatron_ring.perf.bench.device_ring import two_rank_ring
from megatron_ring.perf.report import markdown_table
from megatron_ring.runtime.args import positive_int, usage_error
from megatron_ring.runtime.reporting import write_json_atomic

SIZES: dict[str, dict[str, Any]] = {
    "gpu": dict(kernel_seq=4096, seqs=[8192, 32768, 65536], dims=[64, 128], ring_seq=65536, sizes=[2, 4, 8, 16],
                batches=[1, 32, 128], cached=[8192, 131072], masked_seq=32768, masked_err_seq=2048, masked_heads=(32, 8),
                pair_seq=4096, trace_seq=16384),
    "cpu": dict(kernel_seq=64, seqs=[128], dims=[32], ring_seq=256, sizes=[2, 4], batches=[1, 2], cached=[64],
                masked_seq=128, masked_err_seq=64, masked_heads=(4, 1), pair_seq=64, trace_seq=64),
}
COLUMNS = ("check", "case", "metric", "value", "target", "ok")


def _checks(device: torch.device, sizes: dict[str, Any], repeats: int,
            out: Path) -> dict[str, Callable[[], Iterable[dict[str, Any]]]]:
    dtypes = [torch.bfloat16, torch.float16] if device.type == "cuda" else [torch.float32, torch.bfloat16]
    low = dtypes[0]
    return {
        "kernels": lambda: checks.kernels(device, dtypes, sizes["kernel_seq"], sizes["dims"][-1]),
        "block_vs_sdpa": lambda: checks.block_vs_sdpa(device, low, sizes["seqs"], sizes["dims"], repeats),
        "decomposition": lambda: checks.decomposition(device, low, sizes["ring_seq"], sizes["sizes"],
                                                      sizes["dims"][-1], repeats),
        "decode": lambda: checks.decode(device, low, sizes["batches"], sizes["cached"], sizes["dims"][-1], repeats),
        "masked": lambda: checks.masked(device, low, sizes["masked_seq"], sizes["masked_err_seq"], sizes["masked_heads"],
                                        sizes["dims"][-1], repeats),
        "two_rank_ring": lambda: two_rank_ring(device.type == "cpu", sizes["pair_seq"], sizes["trace_seq"], out),
    }


def versions() -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    return {"date": datetime.date.today().isoformat(), "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(0) if cuda else platform.processor(),
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None}


def run(out: Path, dry_run: bool, repeats: int, only: list[str] | None) -> list[dict[str, Any]]:
    """Every check (or ``only`` those), one failed row for a check that raises."""
    device = torch.device("cpu") if dry_run else torch.device("cuda", 0)
    sizes = SIZES["cpu" if dry_run else "gpu"]
    rows: list[dict[str, Any]] = []
    for name, check in _checks(device, sizes, repeats, out).items():
        if only and name not in only:
            continue
        try:
            found = list(check())
        except Exception as err:  # one broken check must not cost the others their device time
            found = [checks.row(name, "failed", f"{type(err).__name__}: {err}", float("nan"), None, False)]
        rows += found
        print(f"{name}: {len(found)} rows, {sum(r['ok'] is False for r in found)} failed", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_ring.perf.bench.device_check", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for device_check.json and device_check.md")
    parser.add_argument("--cpu-dry-run", action="store_true", help="tiny sizes on CPU, two gloo ranks (CI)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs per figure (median)")
    parser.add_argument("--only", nargs="+", choices=list(_checks(torch.device("cpu"), SIZES["cpu"], 1, Path())),
                        help="run only these checks")
    args = parser.parse_args(argv)
    if not args.cpu_dry_run and not torch.cuda.is_available():
        return usage_error(parser.prog, "no CUDA device: run on the GPU, or pass --cpu-dry-run")
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / ".writable").touch()
        (args.out / ".writable").unlink()
    except OSError as err:
        return usage_error(parser.prog, f"--out {args.out} is not a writable folder: {err.strerror}")
    rows = run(args.out, args.cpu_dry_run, args.repeats, args.only)
    table = markdown_table(COLUMNS, [[r["check"], r["case"], r["metric"], f"{r['value']:.4g}", r["target"] or "",
                                      {True: "yes", False: "**no**", None: ""}[r["ok"]]] for r in rows])
    meta = versions() | {"cpu_dry_run": args.cpu_dry_run, "repeats": args.repeats}
    write_json_atomic(args.out / "device_check.json", {"versions": meta, "rows": rows})
    (args.out / "device_check.md").write_text(f"Device check, {meta['device']}, torch {meta['torch']}, "
                                              f"CUDA {meta['cuda']}, NCCL {meta['nccl']}, {meta['date']}\n\n{table}\n")
    print(table)
    return 1 if any(r["ok"] is False for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
