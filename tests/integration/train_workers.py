"""Workers for the training tests, run on every rank of a :class:`megatron_ring.testing.gloo.GlooPool`.

They take a whole training config mapping (DeepSpeed keys + ``megatron_ring`` section), run it on
the pool's already initialised gloo group (CPU, Megatron shims applied) and return what the tests
compare: per-step losses, and the full (TP-gathered) fp32 weights on rank 0.
"""
from __future__ import annotations

import copy
import json
import multiprocessing
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from megatron_ring.training.loop import init_model_parallel, train
from megatron_ring.training.schema import parse_megatron_args, parse_train_spec


def changed(raw: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    """A copy of config ``raw`` with the key at ``dotted`` (``a.b.c``) set to ``value`` (None: removed)."""
    raw = copy.deepcopy(raw)
    *path, key = dotted.split(".")
    target = raw
    for part in path:
        target = target[part]
    if value is None:
        del target[key]
    else:
        target[key] = value
    return raw


def full_weights(module: torch.nn.Module, tp_group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """fp32 copies of every parameter, TP shards concatenated along their partition dim."""
    out: dict[str, torch.Tensor] = {}
    tp = tp_group.size()
    for name, param in module.named_parameters():
        value = param.detach().float()
        if tp > 1 and getattr(param, "tensor_model_parallel", False):
            parts = [torch.empty_like(value) for _ in range(tp)]
            dist.all_gather(parts, value.contiguous(), group=tp_group)
            value = torch.cat(parts, dim=param.partition_dim)
        out[name] = value.clone()
    return out


def engine_weights(engine: Any, groups: Any) -> dict[str, torch.Tensor]:
    """The whole model's fp32 weights by global name: every chunk of every pipeline stage, TP-gathered."""
    from megatron_ring.integrations.megatron.model import global_name
    from megatron_ring.training.megatron_engine import MegatronTrainer

    if not isinstance(engine, MegatronTrainer):
        return full_weights(engine.module, groups.tp)
    mine = {global_name(m, name): value for m in engine.model_chunks
            for name, value in full_weights(m, groups.tp).items()}
    if groups.layout.pp == 1:
        return mine
    stages: list[Any] = [None] * groups.layout.pp
    dist.all_gather_object(stages, mine, group=groups.groups["pp"])
    return {k: v for stage in stages for k, v in stage.items()}


@contextmanager
def scoped_groups() -> Iterator[None]:
    """Destroy the process groups created inside the block (Megatron's parallel_state, DeepSpeed's,
    ours) when it ends, so that a pool worker running many configs does not accumulate gloo
    groups and their threads; DeepSpeed's references to them are cleared. Groups that existed
    before are left alone."""
    from megatron_ring.integrations.deepspeed.process_group import forget_deepspeed_groups
    from megatron_ring.integrations.megatron.state import forget_parallel_state
    from megatron_ring.parallel.groups import destroy_groups

    before = set(dist.distributed_c10d._world.pg_map)
    try:
        yield
    finally:
        forget_parallel_state()
        forget_deepspeed_groups()
        destroy_groups(lambda group: group not in before)


@contextmanager
def children_allowed() -> Iterator[None]:
    """Let this (daemonic) pool worker start processes inside the block: Megatron's
    ``dist_checkpointing`` writes through a spawned queue manager and forked writers, which a
    launcher's ranks (not daemonic) may start and a daemonic process may not."""
    config = multiprocessing.current_process()._config
    daemon = config.get("daemon")
    config["daemon"] = False
    try:
        yield
    finally:
        config["daemon"] = daemon


def run_config(raw: dict[str, Any], base_dir: str, *, weights: bool = True) -> dict[str, Any]:
    """Train ``raw`` to its last step on this rank; ``{"losses", "start_step", "weights"}``.

    ``weights`` (rank 0 only, else None) are the full model weights after the last step.
    """
    with scoped_groups(), children_allowed():
        return _run_config(raw, base_dir, weights=weights)


def trained(raw: dict[str, Any], base_dir: str) -> tuple[Any, Any, Any]:
    """(spec, groups, run) of the training config ``raw`` run to its end on this pool's ranks."""
    # what a launcher would have set (DeepSpeed's engine insists on LOCAL_RANK); one host
    os.environ.update(RANK=str(dist.get_rank()), LOCAL_RANK=str(dist.get_rank()),
                      WORLD_SIZE=str(dist.get_world_size()))
    if "megatron_ring" in raw:
        spec = parse_train_spec(raw, world_size=dist.get_world_size(), base_dir=Path(base_dir))
    else:  # a YAML with Megatron-LM's names
        spec = parse_megatron_args(raw, world_size=dist.get_world_size(), base_dir=Path(base_dir))
    groups = init_model_parallel(spec, torch.device("cpu"))
    return spec, groups, train(spec, groups, torch.device("cpu"))


def _run_config(raw: dict[str, Any], base_dir: str, *, weights: bool) -> dict[str, Any]:
    _, groups, run = trained(raw, base_dir)
    full: Optional[dict[str, torch.Tensor]] = None
    if weights:
        full = engine_weights(run.engine, groups)
        if dist.get_rank() != 0:
            full = None
    result = {"losses": [r["loss"] for r in run.records], "start_step": run.start_step, "weights": full,
              "evals": {r["step"]: r["eval_loss"] for r in run.evals}}
    run.engine.destroy()
    return result


def group_ranks(layout: dict[str, int]) -> dict[str, dict[str, list[int]]]:
    """This rank's groups two ways, axis -> global ranks: :func:`~megatron_ring.integrations.megatron.state.
    process_group_collection` of our own :func:`~megatron_ring.init_parallel` groups, and Megatron's
    ``ProcessGroupCollection.use_mpu_process_groups()`` after ``initialize_model_parallel``."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_ring.parallel.groups import init_parallel
    from megatron_ring.parallel.layout import ParallelLayout
    from megatron_ring.integrations.megatron.state import init_megatron, process_group_collection

    with scoped_groups():
        init_megatron(ParallelLayout(**layout))
        ours = process_group_collection(init_parallel(ParallelLayout(**layout)))
        megatron = ProcessGroupCollection.use_mpu_process_groups()
        axes = ("tp", "pp", "cp", "dp", "dp_cp", "tp_cp", "mp")
        return {name: {axis: dist.get_process_group_ranks(getattr(pgs, axis)) for axis in axes}
                for name, pgs in (("ours", ours), ("megatron", megatron))}


def run_or_refuse(raw: dict[str, Any], base_dir: str, *, nan_at_call: Optional[int] = None) -> dict[str, Any]:
    """:func:`run_config` without weights; a refusal becomes ``{"error": "Type: message"}``.

    ``nan_at_call``: the loss of that (1-based) step of this run reads NaN (the step itself runs).
    """
    from megatron_ring.config import ConfigError
    from megatron_ring.training import loop
    from megatron_ring.training.checkpoint import TrainingStopped

    real, calls = loop.train_step, [0]

    def step(*args: Any, **kwargs: Any) -> float:
        calls[0] += 1
        loss = real(*args, **kwargs)
        return float("nan") if calls[0] == nan_at_call else loss

    loop.train_step = step
    try:
        return run_config(raw, base_dir, weights=False)
    except (ConfigError, TrainingStopped) as err:
        return {"error": f"{type(err).__name__}: {err}"}
    finally:
        loop.train_step = real


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / max |b|`` in float64."""
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def run_on_pool(pool: Any, raw: dict[str, Any], base_dir: str) -> dict[str, Any]:
    """:func:`run_config` on every rank of ``pool``; rank 0's result, after checking every rank saw the same losses."""
    results = pool.run(run_config, raw, base_dir, timeout_s=300)
    losses = {tuple(r["losses"]) for r in results}
    assert len(losses) == 1, f"ranks disagree on the step losses: {losses}"
    return results[0]


_ONCE: dict[str, dict[str, Any]] = {}
"""Results of :func:`once`, by config, for this test process."""


def once(raw: dict[str, Any], compute: Callable[[], dict[str, Any]], how: str = "run_config") -> dict[str, Any]:
    """``compute()`` (a run of config ``raw``) the first time this test process asks for ``(how, raw)``,
    the same result after: a reference run (cp = 1) or another run that several tests compare with is
    trained once per test run, whichever test or module asks first. Only for runs that write
    nothing (no ``checkpoint.dir``); callers must not change the result."""
    assert (raw.get("megatron_ring", {}).get("checkpoint") or {}).get("dir") is None and raw.get("save") is None, \
        "a run that saves is not shared"
    key = json.dumps([how, raw], sort_keys=True)
    if key not in _ONCE:
        _ONCE[key] = compute()
    return _ONCE[key]


def run_once(pool: Any, raw: dict[str, Any], base_dir: str) -> dict[str, Any]:
    """:func:`run_on_pool` of ``raw``, trained once per test process (:func:`once`)."""
    return once(raw, lambda: run_on_pool(pool, raw, base_dir), how=f"run_config {base_dir}")


def assert_same_training(got: dict[str, Any], ref: dict[str, Any], what: str, *, loss_tol: float,
                         weight_tol: float) -> None:
    """Every step's loss within ``loss_tol``, every final weight within ``weight_tol``, relative, and the
    held-out losses (``eval`` section) of the steps both runs evaluated within ``loss_tol``."""
    assert len(got["losses"]) == len(ref["losses"]), f"{what}: {len(got['losses'])} vs {len(ref['losses'])} steps"
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"]), 1):
        assert abs(a - b) <= loss_tol * abs(b), f"{what}: step {step} loss {a} vs {b}"
    evals, ref_evals = got.get("evals", {}), ref.get("evals", {})
    if evals and ref_evals and got["start_step"] == ref["start_step"]:
        assert evals.keys() == ref_evals.keys(), f"{what}: held-out losses at steps {sorted(evals)} vs {sorted(ref_evals)}"
    for step in evals.keys() & ref_evals.keys():
        a, b = evals[step], ref_evals[step]
        assert abs(a - b) <= loss_tol * abs(b), f"{what}: held-out loss after step {step}: {a} vs {b}"
    assert got["weights"].keys() == ref["weights"].keys()
    worst = max(got["weights"], key=lambda k: relative_error(got["weights"][k], ref["weights"][k]))
    err = relative_error(got["weights"][worst], ref["weights"][worst])
    assert err <= weight_tol, f"{what}: final weight {worst} differs, rel {err:.2e}"

