"""Workers of the lm-eval model tests: one lm-eval run on every rank of a gloo pool."""
from __future__ import annotations

import os
from typing import Any


def evaluate(model_args: dict[str, Any], tasks: list[str], metadata: dict[str, Any]) -> dict[str, Any]:
    """lm-eval's ``simple_evaluate`` of the model ``megatron_ring`` on the shipped ``tasks``: per task, each
    sample's responses (``filtered_resps``) in document order, and the aggregated metrics."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from megatron_ring.eval.harness_main import TASKS_DIR
    from megatron_ring.eval.harness_model import RingHarnessModel

    model = RingHarnessModel(**model_args)
    manager = TaskManager(include_path=str(TASKS_DIR), include_defaults=False, metadata={**model_args, **metadata})
    results = simple_evaluate(model=model, tasks=tasks, task_manager=manager, log_samples=True)
    samples = {task: [s["filtered_resps"] for s in sorted(rows, key=lambda s: s["doc_id"])]
               for task, rows in results["samples"].items()}
    return {"samples": samples, "metrics": results["results"]}
