"""The training engines behind one protocol (Note [One engine protocol] in megatron_ring/training/engine.py):
the loop never asks which engine it drives, every engine name has one class implementing every member of
:class:`~megatron_ring.training.engine.Engine`, and the refusal of a batch without tokens is written once.

Read from the source with ``ast`` (no framework is imported)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from megatron_ring.training import engine as engine_module
from megatron_ring.training.checkpoint import ENGINES
from megatron_ring.training.global_loss import NO_TOKENS, global_mean

ROOT = Path(__file__).resolve().parents[2]
TRAINING = ROOT / "megatron_ring" / "training"
CLASSES = {"deepspeed": ("deepspeed_engine.py", "DeepSpeedTrainer"), "megatron": ("megatron_engine.py", "MegatronTrainer")}


def protocol_members() -> set[str]:
    """The methods and attributes :class:`Engine` declares."""
    tree = ast.parse((TRAINING / "engine.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Engine")
    return {n.name for n in cls.body if isinstance(n, ast.FunctionDef)} | \
        {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


def class_members(file: str, name: str) -> set[str]:
    tree = ast.parse((TRAINING / file).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    found = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    for node in cls.body:
        if isinstance(node, ast.Assign):
            found.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return found


def test_every_engine_name_has_one_class_with_every_member() -> None:
    assert set(engine_module._BUILDERS) == set(ENGINES) == set(CLASSES)
    members = protocol_members()
    assert {"step", "save", "load", "destroy"} <= members, members
    for engine, (file, name) in CLASSES.items():
        missing = members - class_members(file, name)
        assert not missing, f"{name} (engine {engine!r}) lacks {sorted(missing)} of the Engine protocol"


def test_the_loop_never_asks_which_engine() -> None:
    """No ``isinstance`` on an engine class, no comparison of ``...engine`` with a name, no import of an engine
    module: the loop talks to :class:`Engine` only (build_engine chooses once)."""
    tree = ast.parse((TRAINING / "loop.py").read_text())
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
            bad.append(f"line {node.lineno}: isinstance")
        if isinstance(node, ast.Compare) and any(isinstance(side, ast.Attribute) and side.attr == "engine"
                                                 for side in [node.left, *node.comparators]):
            bad.append(f"line {node.lineno}: a comparison of .engine")
        if isinstance(node, ast.ImportFrom) and node.module and node.module.endswith(("megatron_engine",
                                                                                      "deepspeed_engine")):
            bad.append(f"line {node.lineno}: imports {node.module}")
    assert not bad, "training/loop.py dispatches on the engine:\n" + "\n".join(bad)


def test_a_batch_without_tokens_is_refused_in_one_place() -> None:
    with pytest.raises(ValueError, match="no valid token"):
        global_mean(torch.zeros(()), torch.zeros(()))
    assert global_mean(torch.tensor(6.0), torch.tensor(4.0)) == 1.5
    writers = [p.relative_to(ROOT) for p in (ROOT / "megatron_ring").rglob("*.py") if NO_TOKENS in p.read_text()]
    assert writers == [Path("megatron_ring/training/global_loss.py")], writers
