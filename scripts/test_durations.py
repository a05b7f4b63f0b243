"""Where the test suite's time goes: the slowest tests and each folder's and file's share.

    bash scripts/test.sh --junitxml=/tmp/junit.xml                   # any run that writes a junit XML
    python scripts/test_durations.py /tmp/junit.xml --store tests/durations.json
    python scripts/test_durations.py                                  # reads tests/durations.json
    python scripts/test_durations.py --top 40 --files                 # more tests, and per-file totals

The stored JSON maps each test id (``tests/gloo/test_x.py::test_y[case]``) to its seconds (setup,
call and teardown together, as junit counts them) and records when and how the run was made.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STORED = ROOT / "tests" / "durations.json"


def xdist_group_dropped(name: str) -> str:
    """A junit test name without the ``@GROUP`` suffix of ``--dist loadgroup`` (Note [Group suffix] in
    tests/conftest.py): ``test_x@launchers+core`` -> ``test_x``; pytest's junit writer puts a
    parametrized test's ``[a]@launchers+core`` back as ``[a]@launchers+core]`` -> ``[a]``."""
    at = name.rfind("@")
    tail = name[at + 1:]
    if at < 0 or "[" in tail:
        return name
    if "]" not in tail or (tail.endswith("]") and tail.count("]") == 1 and name[at - 1:at] == "]"):
        return name[:at]
    return name


def read_junit(path: Path) -> tuple[dict[str, float], dict[str, float]]:
    """(test id -> wall seconds, test id -> CPU seconds) from a pytest junit XML (``classname`` is the
    dotted module path; the CPU seconds are the ``cpu_s`` property tests/conftest.py records)."""
    times: dict[str, float] = {}
    cpu: dict[str, float] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        module, _, cls = case.get("classname", "").partition(".Test")
        file = module.replace(".", "/") + ".py"
        test = xdist_group_dropped(case.get("name", ""))
        name = f"{file}::Test{cls}::{test}" if cls else f"{file}::{test}"
        times[name] = times.get(name, 0.0) + float(case.get("time", 0.0))
        for prop in case.iter("property"):
            if prop.get("name") == "cpu_s":
                cpu[name] = cpu.get(name, 0.0) + float(prop.get("value", 0.0))
    return times, cpu


def load(path: Path) -> tuple[dict[str, float], dict[str, float], dict]:
    """(test id -> seconds, test id -> CPU seconds, the run's record) from a junit XML or a stored JSON."""
    if path.suffix == ".xml":
        return *read_junit(path), {}
    stored = json.loads(path.read_text())
    return stored["tests"], stored.get("cpu", {}), stored.get("run", {})


def totals(times: dict[str, float], depth: int) -> dict[str, float]:
    """Seconds per path prefix of ``depth`` parts (2: ``tests/gloo``; 3: the file)."""
    out: dict[str, float] = defaultdict(float)
    for name, seconds in times.items():
        out["/".join(name.split("::")[0].split("/")[:depth])] += seconds
    return dict(out)


def report(times: dict[str, float], run: dict, top: int, files: bool) -> str:
    whole = sum(times.values()) or 1.0
    lines = [f"{len(times)} tests, {whole:.0f} s of test time" + (f" ({run['note']})" if run.get("note") else "")]
    lines.append("\nper folder:")
    for folder, seconds in sorted(totals(times, 2).items(), key=lambda kv: -kv[1]):
        count = sum(1 for n in times if n.startswith(folder + "/"))
        lines.append(f"  {seconds:8.1f} s  {100 * seconds / whole:5.1f} %  {count:5d} tests  {folder}")
    if files:
        lines.append("\nper file:")
        for file, seconds in sorted(totals(times, 3).items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"  {seconds:8.1f} s  {100 * seconds / whole:5.1f} %  {file}")
    lines.append(f"\nslowest {top} tests:")
    for name, seconds in sorted(times.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {seconds:8.2f} s  {name}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", nargs="?", type=Path, default=STORED, help="a junit XML or a stored JSON")
    parser.add_argument("--store", type=Path, help="write the durations as JSON here")
    parser.add_argument("--note", default="", help="how the run was made (machine, load average), stored with it")
    parser.add_argument("--top", type=int, default=25, help="how many tests (and files) to list")
    parser.add_argument("--files", action="store_true", help="also list the slowest files")
    args = parser.parse_args(argv)
    if not args.source.is_file():
        parser.error(f"source {str(args.source)!r} is not a file (a junit XML or a stored durations JSON)")
    times, cpu, run = load(args.source)
    if args.store:
        run = {"date": date.today().isoformat(), "note": args.note, "cpus": os.cpu_count(),
               "wall_s_of_tests": round(sum(times.values()), 1), "cpu_s_of_tests": round(sum(cpu.values()), 1)}
        stored = {"run": run, "tests": {k: round(v, 3) for k, v in sorted(times.items())},
                  "cpu": {k: round(v, 3) for k, v in sorted(cpu.items())}}
        args.store.write_text(json.dumps(stored, indent=0) + "\n")
    print(report(times, run, args.top, args.files))
    if cpu:
        print(report(cpu, {"note": "CPU seconds: each test's process and its ranks"}, args.top, args.files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
