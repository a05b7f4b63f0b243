"""The probe sweep: user actions that must end cleanly (tests/probe and the cases of other folders marked
``probe``), one line per case and a count.

    python scripts/probe.py           # the quick part (also run by the README's test command)
    python scripts/probe.py --slow    # with the slow cases (the deepspeed launcher, more resumes)

Each case fails on a hang, an abort, a raw traceback for a user error, a silently wrong result, a
half-written file or a leftover process; cases that other changes own are expected failures.
"""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

if __name__ == "__main__":
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if "--slow" in sys.argv[1:]:
        env["MEGATRON_RING_PROBE_SLOW"] = "1"
    rest = [a for a in sys.argv[1:] if a != "--slow"]
    cmd = [sys.executable, "-m", "pytest", "-v", "-rxs", "-p", "no:cacheprovider", "-m", "probe", str(ROOT / "tests"), *rest]
    sys.exit(subprocess.call(cmd, cwd=ROOT, env=env))
