"""Shared fixtures: gloo process pools reused across tests, cleaned and probed after every module.

``gloo_pool(P)`` gives a running P-rank :class:`GlooPool`. Pools belong to a family, named by a
module's ``pytest.mark.pool_family(NAME)``: ``"core"`` (the default; pure torch workers) or
``"frameworks"`` (workers that import Megatron-core, DeepSpeed or transformers). The tests are
ordered so that each family's modules run together, and only one family's pools live at a time:
the frameworks' imports, globals and memory never reach the core numerics' ranks, and their ranks
pay those imports (about 6 s of CPU each) once per run. After each module
the pools it used run :func:`megatron_ring.testing.hygiene.reset` on every rank; a rank still
holding more than ``WORKER_THREADS_BOUND`` threads, a gloo thread beyond the world group's, any
process group but the world or a child process is a leak:
the pool is recycled, and the module is named at the end of the run (and fails it). See
tests/README.md.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from megatron_ring.testing import hygiene  # noqa: E402
from megatron_ring.testing.gloo import GlooPool, WorkerError  # noqa: E402

FAMILIES = ("core", "frameworks")
"""Pool families in the order their modules run."""
WORKER_THREADS_BOUND = 64
"""Threads a worker may hold after a reset (a fresh one holds about 10)."""
WORKER_RSS_BOUND_MB = 1536
"""Resident memory past which a worker is recycled after a module (not a leak: imports and allocator caches grow)."""


@dataclass
class Leak:
    """What a module left in a pool worker after the reset."""

    module: str
    family: str
    size: int
    worst: dict[str, float]

    def __str__(self) -> str:
        numbers = ", ".join(f"{k} {v:g}" for k, v in self.worst.items())
        return f"{self.module} ({self.family} pool of {self.size}): {numbers}"


class Pools:
    """Lazily started :class:`GlooPool` per (family, world size); a broken pool is replaced on next use."""

    def __init__(self) -> None:
        self._pools: dict[tuple[str, int], GlooPool] = {}
        self._used: set[tuple[str, int]] = set()
        self.leaks: list[Leak] = []
        self.worst: dict[str, float] = {}
        """The largest of each probe number seen after any module's reset."""
        self.recycled_for_memory: list[str] = []

    def get(self, family: str, world_size: int) -> GlooPool:
        for key in [k for k in self._pools if k[0] != family]:  # one family alive at a time
            self._pools.pop(key).close()
        key = (family, world_size)
        pool = self._pools.get(key)
        if pool is None or not pool.alive():
            pool = self._pools[key] = GlooPool(world_size, timeout_s=120, setup=hygiene.snapshot)
        self._used.add(key)
        return pool

    def after_module(self, module: str) -> None:
        """Reset the pools ``module`` used; recycle (and record) any whose ranks kept threads or groups."""
        for key in sorted(self._used):
            pool = self._pools.get(key)
            if pool is None or not pool.alive():
                continue
            try:
                per_rank = pool.run(hygiene.reset, timeout_s=60)
            except WorkerError as err:
                self._pools.pop(key).close(force=True)
                self.leaks.append(Leak(module, key[0], key[1], {"reset failed": 1}))
                print(f"\nreset after {module} failed: {err}")
                continue
            worst = {name: max(r[name] for r in per_rank) for name in per_rank[0]}
            self.worst = {name: max(value, self.worst.get(name, value)) for name, value in worst.items()}
            if (worst["threads"] > WORKER_THREADS_BOUND or worst["gloo_threads_added"] > 0 or worst["groups"] > 1
                    or worst["children"] > 0):
                self._pools.pop(key).close()
                self.leaks.append(Leak(module, key[0], key[1], worst))
            elif worst["rss_mb"] > WORKER_RSS_BOUND_MB:
                self._pools.pop(key).close()
                self.recycled_for_memory.append(f"{module} ({key[0]} pool of {key[1]}): {worst['rss_mb']:g} MiB")
        self._used.clear()

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


def family_of(node: pytest.Item | pytest.Module) -> str:
    """The pool family a test (or its module) names with ``pool_family``; ``"core"`` by default."""
    marker = node.get_closest_marker("pool_family")
    family = marker.args[0] if marker else "core"
    if family not in FAMILIES:
        raise pytest.UsageError(f"{node.nodeid}: pool_family {family!r} is not one of {FAMILIES}")
    return family


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "pool_family(name): the gloo pool family of a module's workers "
                                       f"({', '.join(FAMILIES)}; default core)")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each family's tests together (stable: the order within a family is the usual one); under
    ``-n 2 --dist loadgroup`` (scripts/test.sh) each test file goes to one of two processes (Note
    [Two test processes])."""
    items.sort(key=lambda item: FAMILIES.index(family_of(item)))
    loadgroup = bool(getattr(config.option, "loadgroup", False))  # set on an xdist worker under --dist loadgroup
    for item, process in processes_of(items).items():
        item.add_marker(pytest.mark.xdist_group(process))
        if loadgroup and not _grouped(item.nodeid):
            _set_nodeid(item, f"{item.nodeid}@{process}")  # see Note [Group suffix]


def _set_nodeid(item: pytest.Item, nodeid: str) -> None:
    """Give ``item`` the node id ``nodeid``: pytest 9.2 keeps it as a parsed ``NodeId`` in ``_id``,
    earlier versions as a string in ``_nodeid`` (where pytest-xdist 3.8 writes it, in vain under 9.2)."""
    ident = getattr(item, "_id", None)
    if ident is not None and hasattr(type(ident), "parse"):
        item._id = type(ident).parse(nodeid)
    else:
        item._nodeid = nodeid


def _grouped(nodeid: str) -> bool:
    """Whether ``nodeid`` already carries pytest-xdist's ``@group`` suffix (its test for it)."""
    return nodeid.rfind("@") > nodeid.rfind("]")


def cpu_seconds() -> float:
    """CPU seconds of this process and its descendants so far: the ended ones (reaped, counted by the
    kernel) and the running ones (pool ranks, a launcher and its ranks)."""
    import resource

    import psutil

    usages = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    total = sum(usage.ru_utime + usage.ru_stime for usage in usages)
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


_CPU_AT_SETUP: dict[str, float] = {}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _CPU_AT_SETUP[item.nodeid] = cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A test's CPU seconds (set-up to teardown, its processes included) as the junit property
    ``cpu_s``, which scripts/test_durations.py stores beside the wall time."""
    if call.when == "teardown" and item.nodeid in _CPU_AT_SETUP:
        item.user_properties.append(("cpu_s", round(cpu_seconds() - _CPU_AT_SETUP.pop(item.nodeid), 3)))
    yield


STORED_DURATIONS = Path(__file__).with_name("durations.json")
UNKNOWN_TEST_S = 0.5
"""The time assumed for a test that tests/durations.json does not list (a new one)."""
LAUNCHERS, FRAMEWORKS = "launchers+core", "frameworks+core+unit"
"""The two test processes' xdist groups."""


def processes_of(items: list[pytest.Item]) -> dict[pytest.Item, str]:
    """Which of the two test processes runs each item (Note [Two test processes]): the launcher
    tests in one, the frameworks family's and the unit tests in the other, the core family's pool
    test files shared out, the costliest first, to the process with less so far; a test's cost is its
    stored wall seconds (tests/durations.json): a process runs its tests one after the other, so the
    sum of their wall times is when it finishes."""
    stored = json.loads(STORED_DURATIONS.read_text()) if STORED_DURATIONS.exists() else {}
    weights = stored.get("tests", {})
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    load = {LAUNCHERS: 0.0, FRAMEWORKS: 0.0}
    process: dict[str, str] = {}
    shared = []
    for name, file_items in files.items():
        seconds = sum(weights.get(item.nodeid, UNKNOWN_TEST_S) for item in file_items)
        first = file_items[0]
        if first.get_closest_marker("launcher"):
            process[name] = LAUNCHERS
        elif family_of(first) != "core" or "/unit/" in name:
            process[name] = FRAMEWORKS
        else:
            shared.append((seconds, name))
            continue
        load[process[name]] += seconds
    for seconds, name in sorted(shared, reverse=True):
        process[name] = min(load, key=load.get)
        load[process[name]] += seconds
    return {item: process[item.nodeid.split("::")[0]] for item in items}



# Note [Two test processes]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# One pytest process used 1.43 of the 2 cores: the launcher tests mostly wait (the launcher's
# start-up, its once-a-second polls, a peer timeout running out) while the pool tests compute. So
# scripts/test.sh runs two pytest-xdist workers with --dist loadgroup: one runs the tests marked
# ``launcher``, the other the frameworks family and the unit tests (so that only one process pays
# the frameworks' pool start-up), and the core family's pool test files go to either, so that the
# two have about the same stored wall time (tests/durations.json; the sum of a process's wall times
# is when it finishes: balanced by CPU seconds instead, the launcher process, whose tests wait more
# than they compute, finished about 100 s after the other). Launcher tests beside every core pool
# test left the second process idle for the last two minutes of the run (a profile of CPU seconds
# per test: 551 s in that process, 324 s in the other). A file stays in one process, so its
# module-scoped fixtures (a shared launch, a pool) are made once. Each worker keeps its own pools
# and leak records and hands them to the controller, which reports them and fails the run on a leak.
#
# Note [Group suffix]
# ~~~~~~~~~~~~~~~~~~~
# Under --dist loadgroup the controller sends all tests whose node id ends in the same ``@GROUP`` to
# one worker; pytest-xdist's worker appends that suffix in its own pytest_collection_modifyitems to
# tests marked ``xdist_group``. That did not happen here, for two reasons: xdist's hook is an
# ordinary one and runs before ours (``trylast``: after ``-m`` and ``-k`` have deselected, so that
# the split weighs only the selected tests), so it never saw our markers; and it writes
# ``item._nodeid``, which pytest 9.2 no longer reads (the id is a parsed ``NodeId`` in ``item._id``).
# Until 2026-11-27 no test had a suffix: xdist sent single tests to whichever worker was free, each
# file was split over both processes, and each process went back and forth between the two pool
# families, starting pools again and again (a frameworks rank pays about 6 s of imports). So we
# append the suffix ourselves (:func:`_set_nodeid`); test ids and junit names carry it under
# scripts/test.sh, and scripts/test_durations.py drops it.


_POOLS = Pools()


@pytest.fixture(scope="session")
def _pools() -> Iterator[Pools]:
    yield _POOLS
    _POOLS.close()


@pytest.fixture(scope="module")
def gloo_pool(request: pytest.FixtureRequest, _pools: Pools) -> Iterator[Callable[[int], GlooPool]]:
    """``gloo_pool(P)`` -> a running :class:`GlooPool` of P ranks of this module's family; reset after the module."""
    family = family_of(request.node)
    yield lambda world_size: _pools.get(family, world_size)
    _pools.after_module(request.module.__name__)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:  # noqa: ARG001
    """On pytest-xdist's controller: take a finished worker's pool report."""
    report = getattr(node, "workeroutput", {}).get("pool_report")
    if report:
        _POOLS.worst = {k: max(v, _POOLS.worst.get(k, v)) for k, v in report["worst"].items()}
        _POOLS.leaks.extend(report["leaks"])
        _POOLS.recycled_for_memory.extend(report["recycled_for_memory"])


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:  # noqa: ARG001
    if _POOLS.worst:
        numbers = ", ".join(f"{k} {v:g}" for k, v in _POOLS.worst.items())
        terminalreporter.write_line(f"pool workers after each module's reset, at most: {numbers}")
    for line in _POOLS.recycled_for_memory:
        terminalreporter.write_line(f"pool recycled for memory after {line}")
    if _POOLS.leaks:
        terminalreporter.section("pool workers left with threads or process groups (recycled)")
        for leak in _POOLS.leaks:
            terminalreporter.write_line(str(leak))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # a pytest-xdist worker: the controller reports
        workeroutput["pool_report"] = {"worst": _POOLS.worst, "leaks": [str(leak) for leak in _POOLS.leaks],
                                       "recycled_for_memory": _POOLS.recycled_for_memory}
    elif _POOLS.leaks and exitstatus == 0:
        session.exitstatus = 1
