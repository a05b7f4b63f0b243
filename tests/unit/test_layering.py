"""Who may import whom (docs/design.md): the arrows of the package, read from the source with ``ast``.

Every import counts, also one inside a function: a lazy import is still a dependency.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megatron_ring"
STDLIB = set(sys.stdlib_module_names) | {"__future__"}
FRAMEWORKS = {"megatron", "deepspeed", "transformers", "flash_attn", "tokenizers"}
"""Optional frameworks: imported only where a layer above the core needs them."""


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def executed_at_import(tree: ast.AST) -> list[ast.AST]:
    """The nodes of a module that run when it is imported: everything outside function bodies."""
    nodes, todo = [], [tree]
    while todo:
        node = todo.pop()
        nodes.append(node)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))
    return nodes


def imports_of(path: Path, *, at_import: bool = False) -> set[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved); with ``at_import``,
    only those its import executes (not those inside functions)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found: set[str] = set()
    for node in executed_at_import(tree) if at_import else ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return found


def library_modules() -> dict[str, set[str]]:
    """Every module of the package -> the package's modules it imports."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        graph[name] = {m for m in imports_of(path) if m in files}
    return graph


def layer(module: str) -> str:
    """``attention``, ``integrations.megatron``, ``cli`` ...: the part of the package a module belongs to."""
    parts = module.split(".")[1:]
    if not parts:
        return "package"
    if parts[0] == "integrations" and len(parts) > 1:
        return f"integrations.{parts[1]}"
    return parts[0]


def top(name: str) -> str:
    return name.split(".")[0]


CORE = ("megatron_ring.attention", "megatron_ring.parallel", "megatron_ring.costs")
"""The core: attention, process groups and the cost model they share with the planner."""


def test_core_imports_only_stdlib_torch_and_itself() -> None:
    bad = []
    for path in [p for sub in ("attention", "parallel", "costs") for p in (PACKAGE / sub).rglob("*.py")]:
        allowed = {"flash_attn"} if path.name == "flash_attn_backend.py" else set()
        costs = "costs" in path.parts  # numbers: neither torch nor the tensor code of attention/ and parallel/
        for name in imports_of(path):
            ok = top(name) in STDLIB | allowed | (set() if costs else {"torch"}) \
                or name.startswith("megatron_ring.costs" if costs else CORE)
            if not ok:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "the core (attention/, parallel/, costs/) imports only the standard library, torch and itself " \
        "(costs/: only the standard library and costs/):\n" + "\n".join(bad)


def test_runtime_and_config_import_only_the_core() -> None:
    bad = []
    for sub in ("runtime", "config"):
        for path in (PACKAGE / sub).rglob("*.py"):
            for name in imports_of(path):
                ok = (top(name) in STDLIB | {"torch", "pydantic", "yaml", "tqdm"}
                      or name.startswith((*CORE, f"megatron_ring.{sub}")))
                if sub == "config":
                    ok = ok or name.startswith("megatron_ring.config")
                if not ok:
                    bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "runtime/ and config/ import only the core, pydantic, yaml and tqdm:\n" + "\n".join(bad)


def test_datasets_import_only_the_standard_library() -> None:
    """``datasets/`` builds data from text: any layer may use it, so it depends on nothing of ours."""
    bad = [f"{path.relative_to(ROOT)} imports {name}" for path in (PACKAGE / "datasets").rglob("*.py")
           for name in imports_of(path) if top(name) not in STDLIB and not name.startswith("megatron_ring.datasets")]
    assert not bad, "\n".join(bad)


def test_integrations_never_import_each_other_nor_what_composes_them() -> None:
    bad = []
    for path in (PACKAGE / "integrations").rglob("*.py"):
        mine = layer(module_name(path))
        for name in imports_of(path):
            if not name.startswith("megatron_ring."):
                continue
            theirs = layer(name)
            if theirs.startswith("integrations.") and theirs != mine:
                bad.append(f"{path.relative_to(ROOT)} ({mine}) imports {name} ({theirs})")
            if theirs in ("inference", "training", "perf", "cli", "demo", "testing", "megatron", "hf"):
                bad.append(f"{path.relative_to(ROOT)} imports {name}, a layer above the integrations")
    assert not bad, "\n".join(bad)


def test_inference_and_training_do_not_import_perf() -> None:
    """``perf/`` measures whole runs (sweeps) and models them; what it measures never depends on it."""
    bad = [f"{path.relative_to(ROOT)} imports {name}" for sub in ("inference", "training")
           for path in (PACKAGE / sub).rglob("*.py") for name in imports_of(path)
           if name.startswith(("megatron_ring.perf", "megatron_ring.cli"))]
    assert not bad, "\n".join(bad)


def test_only_the_cli_and_launch_import_eval() -> None:
    """``eval/`` composes inference/ (runners) and datasets/; no other layer of the package imports it."""
    bad = [f"{path.relative_to(ROOT)} imports {name}" for path in PACKAGE.rglob("*.py")
           if layer(module_name(path)) not in ("eval", "cli") for name in imports_of(path)
           if name == "megatron_ring.eval" or name.startswith("megatron_ring.eval.")]
    bad += [f"{path.relative_to(ROOT)} imports {name}" for path in (PACKAGE / "eval").rglob("*.py")
            for name in imports_of(path) if name.startswith(("megatron_ring.training", "megatron_ring.perf"))]
    bad += [f"{path.relative_to(ROOT)} imports {name} (lm-eval belongs to eval/)" for path in PACKAGE.rglob("*.py")
            if layer(module_name(path)) != "eval" for name in imports_of(path) if top(name) == "lm_eval"]
    assert not bad, "eval/ sits beside training/ and perf/, under the CLI only:\n" + "\n".join(bad)


def test_only_the_cli_imports_serving() -> None:
    """``serving/`` composes inference/ (runners, the rank session); only the CLI (and ``check``) imports it, and the web stack
    (fastapi, uvicorn, starlette) is imported there alone."""
    web = {"fastapi", "uvicorn", "starlette"}
    bad = [f"{path.relative_to(ROOT)} imports {name}" for path in PACKAGE.rglob("*.py")
           if layer(module_name(path)) not in ("serving", "cli", "check") for name in imports_of(path)
           if name == "megatron_ring.serving" or name.startswith("megatron_ring.serving.")]
    bad += [f"{path.relative_to(ROOT)} imports {name}" for path in (PACKAGE / "serving").rglob("*.py")
            for name in imports_of(path) if any(name.startswith(f"megatron_ring.{o}") for o in
                                                 ("training", "eval", "perf", "cli", "testing"))]
    bad += [f"{path.relative_to(ROOT)} imports {name} (the web stack belongs to serving/)"
            for path in PACKAGE.rglob("*.py") if layer(module_name(path)) != "serving"
            for name in imports_of(path) if top(name) in web]
    assert not bad, "serving/ sits beside eval/, under the CLI only:\n" + "\n".join(bad)


def test_inference_and_training_never_import_each_other() -> None:
    """Both directions: inference/ never imports training/, training/ never imports inference/."""
    bad = [f"{path.relative_to(ROOT)} imports {name}"
           for sub, other in (("inference", "training"), ("training", "inference"))
           for path in (PACKAGE / sub).rglob("*.py") for name in imports_of(path)
           if name == f"megatron_ring.{other}" or name.startswith(f"megatron_ring.{other}.")]
    assert not bad, "inference/ and training/ do not import each other:\n" + "\n".join(bad)


def test_frameworks_stay_out_of_the_package_import() -> None:
    """``import megatron_ring`` needs torch alone: the modules it loads import no optional framework."""
    graph = library_modules()
    seen, todo = set(), ["megatron_ring"]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(graph.get(name, ()))
    bad = []
    for name in sorted(seen):
        path = ROOT / Path(*name.split("."))
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        bad += [f"{name} imports {m}" for m in imports_of(path, at_import=True) if top(m) in FRAMEWORKS]
    assert not bad, "\n".join(bad)


def test_nothing_outside_tests_imports_testing() -> None:
    sources = [p for p in PACKAGE.rglob("*.py") if "testing" not in p.relative_to(PACKAGE).parts[:1]]
    sources += list((ROOT / "launch").glob("*.py")) + list((ROOT / "examples").glob("*.py"))
    bad = [f"{p.relative_to(ROOT)} imports {name}" for p in sources for name in imports_of(p)
           if name == "megatron_ring.testing" or name.startswith("megatron_ring.testing.")]
    assert not bad, "megatron_ring.testing serves tests only:\n" + "\n".join(bad)


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` (as a list of modules, first = last), or [] if there is none.

    A package's ``__init__`` is left out as the target of an edge from its own submodules: importing
    ``pkg.mod`` loads ``pkg`` first by definition, which is not a cycle of the code.
    """
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if node.startswith(nxt + "."):
                continue
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return []


def test_package_has_no_import_cycles() -> None:
    cycle = find_cycle(library_modules())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_launch_scripts_only_call_into_the_package() -> None:
    for path in (ROOT / "launch").glob("*.py"):
        tree = ast.parse(path.read_text())
        defined = [n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        assert not defined, f"{path.relative_to(ROOT)} defines {defined}; logic belongs in megatron_ring"
        foreign = {m for m in imports_of(path) if top(m) not in {"sys", "pathlib", "megatron_ring", "__future__"}}
        assert not foreign, f"{path.relative_to(ROOT)} imports {sorted(foreign)}; it should only call into the package"


@pytest.mark.parametrize("module, forbidden, test", [
    ("attention/schedule.py", "import transformers\n", test_core_imports_only_stdlib_torch_and_itself),
    ("costs/traffic.py", "import torch\n", test_core_imports_only_stdlib_torch_and_itself),
    ("costs/traffic.py", "from megatron_ring.attention.comms import CPGroups\n",
     test_core_imports_only_stdlib_torch_and_itself),
    ("attention/schedule.py", "from megatron_ring.testing.fake import fake_world\n",
     test_nothing_outside_tests_imports_testing),
    ("inference/loop.py", "from megatron_ring.training.data import Batch\n",
     test_inference_and_training_never_import_each_other),
    ("training/loop.py", "import megatron_ring.inference.metrics\n",
     test_inference_and_training_never_import_each_other),
    ("training/data.py", "def f():\n    from ..inference import schema\n",
     test_inference_and_training_never_import_each_other),
])
def test_a_forbidden_import_fails_the_check(monkeypatch: pytest.MonkeyPatch, module: str, forbidden: str,
                                             test: object) -> None:
    """The checks above do fail: a forbidden line added to a module is reported (lazy and relative too)."""
    target = PACKAGE / module
    original = target.read_text()
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: (
        original + forbidden if self == target else Path.read_bytes(self).decode()))
    with pytest.raises(AssertionError, match="imports"):
        test()  # type: ignore[operator]


def test_a_cycle_is_found() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"p.m": {"p"}, "p": {"p.m"}}) == []
