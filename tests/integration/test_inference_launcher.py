"""launch/infer.py under the real DeepSpeed launcher (CPU processes, gloo).

End to end runs of the CPU pair (the toy reference runner's tokens are checked in process:
test_inference_greedy.py), config errors caught before anything is built, and a rank killed mid-run
(Note [Lost ranks]).

The launches of the first three tests do not depend on each other: the module starts those of the
selected tests side by side (:func:`side_by_side`, each in a folder of its own) and each test waits for
its own; the killed-rank test, which times the survivors' exit, runs alone after them.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

from megatron_ring.runtime.pool import free_port

pytestmark = [pytest.mark.integration, pytest.mark.launcher]

ROOT = Path(__file__).resolve().parents[2]
DEEPSPEED = Path(sys.executable).parent / "deepspeed"
HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None and DEEPSPEED.exists()
needs_deepspeed = pytest.mark.skipif(not HAVE_DEEPSPEED, reason="deepspeed launcher not installed")

TOY_MODEL = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_query_groups": 2,
             "ffn_hidden_size": 128, "vocab_size": 128}


def toy_config(tmp_path: Path, name: str, *, cp: int, dp: int = 1, **workload: int) -> Path:
    work = {"batch": 2, "prompt_len": 32, "new_tokens": 6, "warmup": 1, "repeats": 2, "seed": 3}
    work.update(workload)
    cfg = {"dtype": "fp32", "replace_with_kernel_inject": False,
           "megatron_ring": {"model": {"runner": "toy", "config": TOY_MODEL}, "layout": {"cp": cp, "dp": dp},
                             "workload": work, "output": str(tmp_path / f"{name}.json")}}
    path = tmp_path / f"{name}_config.json"
    path.write_text(json.dumps(cfg))
    return path


def launch_cmd(config: Path, nprocs: int, *extra: str) -> list[str]:
    return [str(DEEPSPEED), "--num_gpus", str(nprocs), "--master_port", str(free_port()),
            str(ROOT / "launch" / "infer.py"), "--deepspeed_config", str(config), *extra]


def env() -> dict[str, str]:
    return {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}


def start(cmd: list[str], **kwargs) -> subprocess.Popen:
    """Start a launcher in its own process group, so that :func:`stop` can end all it started."""
    return subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.STDOUT, start_new_session=True,
                            **{"env": env(), "stdout": subprocess.PIPE, **kwargs})


def stop(proc: subprocess.Popen) -> None:
    """Kill the launcher's process group (launcher, its launch.py and every rank) if still there."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class Job:
    """Processes of one test, started side by side with other tests' (:func:`side_by_side`); their
    output goes to files, so that no pipe fills while nobody reads it."""

    def __init__(self, folder: Path, commands: dict[str, list[str]], **kwargs) -> None:
        self.logs = {name: folder / f"{name}.out" for name in commands}
        self.procs: dict[str, subprocess.Popen] = {}
        try:
            for name, cmd in commands.items():
                with self.logs[name].open("wb") as sink:
                    self.procs[name] = start(cmd, stdout=sink, **kwargs)
        except BaseException:
            self.stop()
            raise

    def finish(self, timeout: float = 400) -> dict[str, str]:
        """Wait for every process (all killed after ``timeout`` s or on any failure); their outputs."""
        deadline = time.monotonic() + timeout
        try:
            for proc in self.procs.values():
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        finally:
            self.stop()
        return {name: log.read_text(errors="replace") for name, log in self.logs.items()}

    def stop(self) -> None:
        for proc in self.procs.values():
            stop(proc)
            proc.wait()


def bad_configs(folder: Path) -> dict[str, tuple[dict | None, list[str]]]:
    """Name -> (config, needles of its error) for test_bad_configs_fail_before_anything_is_built."""
    unknown = json.loads(toy_config(folder, "a", cp=2).read_text())
    unknown["megatron_ring"]["workload"]["promt_len"] = unknown["megatron_ring"]["workload"].pop("prompt_len")
    ds_unknown = json.loads(toy_config(folder, "b", cp=2).read_text())
    ds_unknown["dtpye"] = "fp32"
    bad_model = json.loads(toy_config(folder, "c", cp=2).read_text())
    bad_model["megatron_ring"]["model"]["config"]["num_query_groups"] = 3
    return {
        "unknown": (unknown, ["unknown key 'megatron_ring.workload.promt_len'", "did you mean 'prompt_len'"]),
        "ds_unknown": (ds_unknown, ["unknown key 'dtpye'", "did you mean 'dtype'"]),
        "model": (bad_model, ["num_query_groups = 3", "num_attention_heads = 4"]),
        "malformed": (None, ["bad_malformed.json", "is not valid JSON", "line 1, column"]),
    }


CPU_PAIR = ("cpu_baseline_tp2_pp2", "cpu_ring_cp4")


def start_cpu_pair(folder: Path) -> Job:
    return Job(folder, {name: launch_cmd(ROOT / "configs" / "deepspeed" / f"{name}.json", 4,
                                         "--output", str(folder / f"{name}.json")) for name in CPU_PAIR})


def start_bad_configs(folder: Path) -> Job:
    commands = {}
    for name, (cfg, _) in bad_configs(folder).items():
        path = folder / f"bad_{name}.json"
        path.write_text(json.dumps(cfg) if cfg is not None else '{"dtype": "fp32",, }')
        commands[name] = [sys.executable, str(ROOT / "launch" / "infer.py"), "--deepspeed_config", str(path)]
    return Job(folder, commands, env={**env(), "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})


def start_world_mismatch(folder: Path) -> Job:
    return Job(folder, {"world": launch_cmd(toy_config(folder, "world", cp=4), 2)})


STARTS: dict[str, Callable[[Path], Job]] = {
    "test_cpu_pair_end_to_end": start_cpu_pair,
    "test_bad_configs_fail_before_anything_is_built": start_bad_configs,
    "test_layout_not_matching_launched_world_fails_on_every_rank": start_world_mismatch,
}
"""Test name -> what starts its processes in a fresh folder."""


@pytest.fixture(scope="module")
def side_by_side(request: pytest.FixtureRequest,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Path, Job]]]:
    """Test name -> (its folder, its started job) for the selected tests of :data:`STARTS`, all started
    on first use (a test needing the deepspeed launcher is left out where it would be skipped)."""
    jobs: dict[str, tuple[Path, Job]] = {}
    try:
        for item in request.session.items:
            if item.module is not request.module or item.name not in STARTS:
                continue
            if item.get_closest_marker("skipif") is not None and not HAVE_DEEPSPEED:
                continue
            folder = tmp_path_factory.mktemp(item.name[:30])
            jobs[item.name] = folder, STARTS[item.name](folder)
        yield jobs
    finally:
        for _, job in jobs.values():
            job.stop()


def started(request: pytest.FixtureRequest, side_by_side: dict[str, tuple[Path, Job]]) -> tuple[Path, Job]:
    assert request.node.name in side_by_side, f"{request.node.name} was not started"
    return side_by_side[request.node.name]


METRIC_KEYS = {"ttft_ms", "tpot_mean_ms", "tpot_p50_ms", "tpot_p99_ms", "prefill_tps", "decode_tps",
               "overall_tps", "e2e_per_token_ms", "prefill_s", "decode_s"}
RANK_KEYS = {"rank", "coords", "peak_mem_bytes", "peak_device_bytes", "peak_rss_bytes", "kv_cache_bytes",
             "comm_prefill_bytes", "comm_decode_bytes"}


def check_result(path: Path, world: int, *, repeats: int, batch: int, new_tokens: int) -> dict:
    result = json.loads(path.read_text())
    assert set(result["metrics"]) == METRIC_KEYS
    assert all(v > 0 for v in result["metrics"].values())
    assert len(result["requests"]) == repeats
    assert [r["rank"] for r in result["ranks"]] == list(range(world))
    for rank in result["ranks"]:
        assert set(rank) == RANK_KEYS and rank["peak_mem_bytes"] > 0 and rank["kv_cache_bytes"] > 0
    assert len(result["generated"]) == batch and all(len(s) == new_tokens for s in result["generated"])
    return result


@needs_deepspeed
def test_cpu_pair_end_to_end(request: pytest.FixtureRequest, side_by_side) -> None:
    """The README's pair, both at once on 4 processes each: the table on stdout, every metric written
    (the ring's traffic counted on every rank), no temporary file left, the same greedy tokens."""
    tmp_path, job = started(request, side_by_side)
    results = {}
    outs = job.finish()
    for name, proc in job.procs.items():
        assert proc.returncode == 0, outs[name][-4000:]
        assert "TPOT p99" in outs[name] and "result written to" in outs[name], outs[name][-4000:]
        work = json.loads((ROOT / "configs" / "deepspeed" / f"{name}.json").read_text())["megatron_ring"]["workload"]
        results[name] = check_result(tmp_path / f"{name}.json", 4, repeats=work["repeats"], batch=work["batch"],
                                     new_tokens=work["new_tokens"])
    assert results["cpu_ring_cp4"]["setup"] == "ring" and results["cpu_baseline_tp2_pp2"]["setup"] == "baseline"
    assert results["cpu_ring_cp4"]["generated"] == results["cpu_baseline_tp2_pp2"]["generated"]
    assert all(rank["comm_prefill_bytes"] > 0 and rank["comm_decode_bytes"] > 0
               for rank in results["cpu_ring_cp4"]["ranks"])
    assert not list(tmp_path.glob(".*.tmp")), "temporary result file left behind"


def test_bad_configs_fail_before_anything_is_built(request: pytest.FixtureRequest, side_by_side) -> None:
    """Unknown keys (ours and DeepSpeed's), model vs layout, a JSON syntax error: exit 2 at once with the reason.

    Validation runs before any process group exists, so one process with the launcher's
    environment (RANK, WORLD_SIZE) is enough; the launcher case is the next test.
    """
    tmp_path, job = started(request, side_by_side)
    cases = bad_configs(tmp_path)
    outs = job.finish()
    assert set(job.procs) == set(cases)
    for name, proc in job.procs.items():
        out = outs[name]
        assert proc.returncode == 2, out
        assert "config error, nothing was started" in out and "Traceback" not in out, out[-2000:]
        for needle in cases[name][1]:
            assert needle in out, f"{name}: {needle!r} missing from\n{out[-2000:]}"
    assert not list(tmp_path.glob("[abc].json")), "a result was written for a rejected config"


@needs_deepspeed
def test_layout_not_matching_launched_world_fails_on_every_rank(request: pytest.FixtureRequest,
                                                               side_by_side) -> None:
    """cp=4 launched on 2 processes: every rank exits before rendezvous, rank 0 says why."""
    tmp_path, job = started(request, side_by_side)
    out = job.finish()["world"]
    code = job.procs["world"].returncode
    assert code != 0
    assert "config error, nothing was started" in out and "layout world size 4" in out \
        and "process world size 2" in out, out[-2000:]
    assert not (tmp_path / "world.json").exists()


def _rank_pid(launcher_pid: int, local_rank: int) -> int | None:
    import psutil

    for child in psutil.Process(launcher_pid).children(recursive=True):
        try:
            if f"--local_rank={local_rank}" in child.cmdline() and "infer.py" in " ".join(child.cmdline()):
                return child.pid
        except psutil.NoSuchProcess:
            continue
    return None


DECODE_STEPS = 5
"""Steps of the first request rank 0's progress bar has counted (the prefill, then one per decode
step) when test_killed_rank_stops_every_other_rank kills a rank: the ranks are in the decode loop."""


def decoding(out: bytes) -> bool:
    """Rank 0's progress bar (``... N/TOTAL [..., request 1/3]``) counted ``DECODE_STEPS`` steps."""
    counts = re.findall(rb"(\d+)/\d+ \[[^\]\r\n]*request 1/3", out)
    return bool(counts) and int(counts[-1]) >= DECODE_STEPS


@needs_deepspeed
def test_killed_rank_stops_every_other_rank(tmp_path: Path) -> None:
    """SIGKILL rank 2 of 4 mid-run: the others exit non-zero within 30 s naming rank 2; no result file."""
    import psutil

    config = toy_config(tmp_path, "fault", cp=4, new_tokens=400, repeats=3, warmup=0, prompt_len=64)
    proc = start(launch_cmd(config, 4))
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: proc.stdout.read1(4096), b"")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        while not decoding(b"".join(chunks)):  # rank 0's progress bar: into the first request's decode
            assert proc.poll() is None, b"".join(chunks).decode(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "the run never got into its first request's decode"
            time.sleep(0.1)
        victim = _rank_pid(proc.pid, 2)
        survivors = [_rank_pid(proc.pid, r) for r in (0, 1, 3)]
        assert victim and all(survivors)
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        gone, alive = psutil.wait_procs([psutil.Process(p) for p in survivors if psutil.pid_exists(p)], timeout=30)
        assert not alive, f"ranks still running 30 s after the kill: {[p.pid for p in alive]}"
        assert time.monotonic() - killed_at < 30
        proc.wait(timeout=30)
    finally:
        stop(proc)
        reader.join(timeout=5)
    out = b"".join(chunks).decode(errors="replace")
    assert proc.returncode != 0
    for rank in (0, 1, 3):
        lines = [ln for ln in out.splitlines() if f"[megatron_ring] rank {rank}:" in ln]
        assert lines and all("rank 2" in ln for ln in lines), f"rank {rank} did not name rank 2:\n{out[-3000:]}"
    assert not (tmp_path / "fault.json").exists(), "a result file was written by a failed run"
    assert not list(tmp_path.glob(".*.tmp"))
