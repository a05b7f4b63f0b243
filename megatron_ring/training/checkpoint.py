"""Training checkpoints: complete markers, checksums, the recorded layout, and honest write errors.

Note [Complete checkpoints]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
``engine.save`` writes each rank's files into ``<dir>/<tag>/`` and ends with a
barrier. Then every rank hashes its share of the tag's files (file ``i`` of the sorted list on
rank ``i mod world``; SHA-256 and size), the shares are gathered, and only then does rank 0 write
``<tag>/complete.json`` (atomically: the step, the data position, the layout and every file's
size and digest) and DeepSpeed's ``latest`` file (atomically). Resume takes the highest step whose
marker exists, so a save interrupted by a lost rank (some files written, no marker) is never taken
for the latest. Before loading, resume compares the marker's layout with this run's (a change is a
:class:`~megatron_ring.config.ConfigError` naming both) and verifies every file against the
marker, again one share per rank, the findings gathered so that every rank refuses together,
naming each truncated, altered or missing file (:class:`CheckpointError`). A marker without
digests (written before they existed) is loaded unverified. The directory is assumed shared by
the ranks, as the marker itself already assumes.
"""
from __future__ import annotations

import errno
import json
import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch.distributed as dist

from megatron_ring.config import ConfigError
from megatron_ring.training.schema import SECTION

if TYPE_CHECKING:
    from megatron_ring.training.data import TrainData
    from megatron_ring.training.schema import TrainSpec

COMPLETE = "complete.json"
"""Marker file of a checkpoint every rank finished writing (see Note [Complete checkpoints])."""
PROBE_BYTES = 1 << 20
"""Size of the probe file that tells a full file system from other write failures."""


class TrainingStopped(RuntimeError):
    """Training cannot go on; the message names the file, step or value and what to do."""


class CheckpointError(TrainingStopped):
    """A checkpoint that cannot be written or trusted (names the file and the cause)."""


def checkpoint_tag(step: int) -> str:
    return f"step{step:08d}"


def latest_checkpoint(ckpt_dir: str | Path) -> Optional[str]:
    """Tag of the highest-step checkpoint in ``ckpt_dir`` with a :data:`COMPLETE` marker, or None."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        return None
    tags = [p.name for p in root.iterdir() if p.is_dir() and p.name.startswith("step") and (p / COMPLETE).is_file()]
    return max(tags, key=lambda t: int(t[4:]), default=None)


def file_digest(path: Path) -> dict[str, Any]:
    """``{"bytes": size, "sha256": hex}`` of ``path``, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def _gathered(local: dict[str, Any]) -> dict[str, Any]:
    """The union of every rank's ``local`` mapping (one all-gather of Python objects)."""
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, local)
    return {k: v for part in every for k, v in part.items()}


def _my_share(names: list[str]) -> list[str]:
    return names[dist.get_rank()::dist.get_world_size()]


def tag_digests(tag_dir: Path) -> dict[str, dict[str, Any]]:
    """Size and digest of every file in ``tag_dir``, each file hashed by one rank (collective)."""
    names = sorted(p.name for p in tag_dir.iterdir() if p.is_file() and p.name != COMPLETE)
    return dict(sorted(_gathered({n: file_digest(tag_dir / n) for n in _my_share(names)}).items()))


def write_failure_cause(folder: Path, err: BaseException) -> str:
    """Why writing into ``folder`` failed: read-only, not permitted, full (a probe file tells), or ``err``."""
    existing = next((p for p in (folder, *folder.parents) if p.is_dir()), Path("/"))
    probe = existing / f".megatron_ring_probe.{os.getpid()}"
    try:
        with probe.open("wb") as fh:
            fh.write(b"\0" * PROBE_BYTES)
            fh.flush()
            os.fsync(fh.fileno())
    except OSError as probe_err:
        reasons = {errno.ENOSPC: "the file system is full", errno.EDQUOT: "the disk quota is exhausted",
                   errno.EROFS: "the file system is read-only", errno.EACCES: "no permission to write there",
                   errno.EPERM: "no permission to write there"}
        why = reasons.get(probe_err.errno or 0, probe_err.strerror or str(probe_err))
        return f"{why} ({str(existing)!r}: {probe_err.strerror or probe_err})"
    finally:
        probe.unlink(missing_ok=True)
    return f"{type(err).__name__}: {err}"


def save_checkpoint(engine: Any, ckpt_dir: Path, step: int, client_state: dict[str, Any]) -> str:
    """Save step ``step`` on every rank; mark it complete, with digests, only when all ranks are done.

    A write failure is a :class:`CheckpointError` naming the directory and the real cause; the
    latest complete checkpoint stays what it was.
    """
    from megatron_ring.runtime.reporting import write_json_atomic

    tag = checkpoint_tag(step)
    tag_dir = ckpt_dir / tag
    try:
        engine.save(ckpt_dir, tag, client_state)
        files = tag_digests(tag_dir)
        if dist.get_rank() == 0:  # engine.save ended with a barrier: every rank's files exist
            write_json_atomic(tag_dir / COMPLETE, {"tag": tag, **client_state, "files": files})
            tmp = ckpt_dir / ".latest.tmp"
            tmp.write_text(tag)
            os.replace(tmp, ckpt_dir / "latest")
    except (OSError, RuntimeError) as err:
        raise CheckpointError(
            f"saving step {step} into {str(tag_dir)!r} failed: {write_failure_cause(tag_dir, err)}; the latest "
            f"complete checkpoint stays {latest_checkpoint(ckpt_dir)}") from err
    dist.barrier()
    return tag


def read_marker(tag_dir: Path) -> dict[str, Any]:
    """The :data:`COMPLETE` marker of a checkpoint."""
    import json

    try:
        return json.loads((tag_dir / COMPLETE).read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint marker {str(tag_dir / COMPLETE)!r} cannot be read: {err}") from None


def check_layout(marker: dict[str, Any], layout: dict[str, int], tag_dir: Path) -> None:
    """ConfigError naming both layouts unless the checkpoint was saved at ``layout``."""
    saved = marker.get("layout")
    if saved is not None and saved != layout:
        def show(sizes: dict[str, int]) -> str:
            return " x ".join(f"{k}={v}" for k, v in sizes.items())

        raise ConfigError(
            f"checkpoint {str(tag_dir)!r} was saved at layout {show(saved)} but this run's layout is {show(layout)}; "
            f"resume needs the same layout (resharding is not supported): set {SECTION}.layout back, or give "
            "a new checkpoint.dir (or checkpoint.resume = false)")


def verify_checkpoint(marker: dict[str, Any], tag_dir: Path) -> None:
    """CheckpointError on every rank naming each file that differs from the marker (collective)."""
    recorded = marker.get("files")
    if recorded is None:
        return
    problems = {}
    for name in _my_share(sorted(recorded)):
        path, want = tag_dir / name, recorded[name]
        if not path.is_file():
            problems[name] = f"{str(path)!r} is missing"
            continue
        got = file_digest(path)
        if got["bytes"] != want["bytes"]:
            problems[name] = (f"{str(path)!r} has {got['bytes']} bytes, the checkpoint wrote {want['bytes']} "
                              "(truncated?)")
        elif got["sha256"] != want["sha256"]:
            problems[name] = f"{str(path)!r} does not match its SHA-256 recorded at save (corrupted)"
    found = _gathered(problems)
    if found:
        raise CheckpointError(f"checkpoint {str(tag_dir)!r} cannot be resumed: " + "; ".join(found.values())
                              + f". Delete {str(tag_dir)!r} to resume from an earlier step")


ENGINES = ("deepspeed", "megatron")
"""The training engines a checkpoint can come from."""


def checkpoint_engine(marker: dict[str, Any], tag_dir: Path) -> str:
    """``deepspeed`` or ``megatron``: the marker's ``engine``, else told by DeepSpeed's files."""
    engine = marker.get("engine")
    if engine is None:
        engine = "deepspeed" if any(tag_dir.glob("*model_states.pt")) else "megatron"
    if engine not in ENGINES:
        raise ValueError(f"checkpoint {str(tag_dir)!r}: engine = {engine!r} in {COMPLETE}; allowed: {ENGINES}")
    return engine


def load_checkpoint(engine: Any, ckpt_dir: Path, tag: str) -> dict[str, Any]:
    """``engine.load`` of ``tag``; any failure (a file the loader cannot read or unpickle, a model of
    another size: Megatron's CheckpointingException, DeepSpeed's assertions) is a CheckpointError naming the
    directory and the cause."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    try:
        client = engine.load(ckpt_dir, tag)
    except (Exception, CheckpointException) as err:  # the loaders raise many types; each becomes one named refusal
        raise CheckpointError(f"checkpoint {str(ckpt_dir / tag)!r} cannot be loaded: {type(err).__name__}: "
                              f"{str(err)[:300]}") from err
    if client is None:
        raise CheckpointError(f"checkpoint {str(ckpt_dir / tag)!r} cannot be loaded (DeepSpeed found no states)")
    return client


def optimizer_settings(spec: "TrainSpec") -> dict[str, Any]:
    """What a resumed run takes from its checkpoint rather than from its config (the optimizer's and the
    schedule's settings), keyed by the config field that sets each: saved with every checkpoint and compared
    on resume (:func:`check_resume`)."""
    if spec.train.engine == "megatron":
        section = spec.train.megatron
        return {f"{SECTION}.megatron.optimizer": section.optimizer.model_dump(mode="json"),
                f"{SECTION}.megatron.scheduler": section.scheduler.model_dump(mode="json")}
    return {key: spec.deepspeed.get(key) for key in ("optimizer", "scheduler", "gradient_clipping")}


def check_resume(client: dict[str, Any], data: "TrainData", spec: "TrainSpec", where: Path) -> None:
    """ConfigError unless the checkpoint's data position means the same samples in this run, and its optimizer
    and schedule settings are the config's (a resumed engine keeps the saved ones: a change would be ignored)."""
    saved, now = client.get("settings"), optimizer_settings(spec)
    if saved is not None and saved != json.loads(json.dumps(now)):
        changed = [f"{key}: {saved.get(key)!r} in the checkpoint, {now.get(key)!r} now" for key in now
                   if saved.get(key) != json.loads(json.dumps(now.get(key)))]
        raise ConfigError(f"checkpoint {str(where)!r} was trained with other optimizer settings; resuming keeps the "
                          "checkpoint's optimizer and schedule state, so the change would be ignored: "
                          + "; ".join(changed) + ". Set them back, or start a new checkpoint.dir (resume: false)")
    if client.get("consumed_samples") != client["step"] * spec.global_batch:
        raise ConfigError(
            f"checkpoint {str(where)!r} consumed {client.get('consumed_samples')} samples in {client['step']} steps, "
            f"but train_batch_size = {spec.global_batch} now; resume needs the same global batch"
        )
    if client.get("data") != data.fingerprint():
        raise ConfigError(
            f"checkpoint {str(where)!r} was trained on data {client.get('data')} but {SECTION}.data now gives "
            f"{data.fingerprint()}; resume needs the same corpus, seq_len and data.seed "
            "(or a new checkpoint.dir)"
        )
