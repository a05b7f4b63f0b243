"""50 requests against ``megatron-ring serve`` (SmolLM2 at cp 2): is every rank's memory flat, does the budget evict?

Starts the server on the shipped config, then sends ``--requests`` chat requests from the openai client:
conversations about slices of the GPL-3 text, each followed up several times; every fifth request is a
stream that the client drops after its first piece, every seventh a bad request. After each request it
reads every rank's resident memory (/proc) and the server's /health. Writes ``OUT/serve_load.json``::

    python scripts/serve_load.py --out docs/results/serve_smollm2
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs/deepspeed/serve_smollm2_cp2.json"


def rank_rss_mb() -> dict[int, float]:
    """Resident MiB of every serve rank on this machine, by its RANK."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            if "megatron_ring.serving.serve_main" not in cmd or "torch.distributed.run" in cmd:
                continue
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            rank = int(next(e for e in env if e.startswith(b"RANK=")).split(b"=")[1])
            status = Path(f"/proc/{pid}/status").read_text()
            out[rank] = int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024
        except (OSError, StopIteration, AttributeError):
            continue
    return dict(sorted(out.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--budget", type=int, default=6000, help="cache_budget_tokens")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from openai import OpenAI, APIStatusError

    log = args.out / "serve_load.log"
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "megatron_ring.cli", "serve", str(CONFIG), "--port", "0",
                             "--cache-budget-tokens", str(args.budget)], stdout=open(log, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        deadline, url = time.monotonic() + 600, None
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            found = re.search(r"on (http://\S+/v1)", log.read_text(errors="replace"))
            url = found.group(1) if found else None
            time.sleep(0.5)
        assert url, log.read_text()[-2000:]
        client = OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
        text = (ROOT / "data/corpus/GPL-3.txt").read_text()
        model = client.models.list().data[0].id
        samples, conversations, started = [], {}, time.perf_counter()
        for i in range(args.requests):
            conv = i % 10
            messages = conversations.get(conv) or [{"role": "user", "content": text[conv * 3000:conv * 3000 + 6000]
                                                    + "\n\nWhat does this part of the license say?"}]
            kind = "bad" if i % 7 == 6 else "dropped stream" if i % 5 == 4 else "chat"
            t0 = time.perf_counter()
            cached = None
            if kind == "bad":
                try:
                    client.chat.completions.create(model=model, messages=messages, max_tokens=0)
                except APIStatusError as err:
                    kind += f" ({err.status_code})"
            elif kind == "dropped stream":
                stream = client.chat.completions.create(model=model, messages=messages, max_tokens=40, stream=True)
                next(iter(stream))
                stream.close()
            else:
                answer = client.chat.completions.create(model=model, messages=messages, max_tokens=24)
                cached = answer.usage.prompt_tokens_details.cached_tokens
                conversations[conv] = messages + [{"role": "assistant", "content": answer.choices[0].message.content},
                                                  {"role": "user", "content": f"And what else? ({i})"}]
            health = json.loads(urllib.request.urlopen(url.rsplit("/v1", 1)[0] + "/health").read())
            samples.append({"request": i, "kind": kind, "seconds": time.perf_counter() - t0, "cached_tokens": cached,
                            "rss_mb": rank_rss_mb(), "health": health})
            print(f"{i:3d} {kind:18s} {samples[-1]['seconds']:6.2f} s cached {cached} rss {samples[-1]['rss_mb']} "
                  f"conversations {health.get('conversations')} evicted {health.get('evicted')}", flush=True)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    ranks = sorted(samples[0]["rss_mb"])
    tenth = max(1, len(samples) // 10)
    summary = {rank: {"after_first_10pct_mb": max(s["rss_mb"].get(rank, 0) for s in samples[:tenth]),
                      "max_mb": max(s["rss_mb"].get(rank, 0) for s in samples),
                      "last_mb": samples[-1]["rss_mb"].get(rank)} for rank in ranks}
    result = {"requests": args.requests, "budget_tokens": args.budget, "wall_s": time.perf_counter() - started,
              "exit_code": code, "drained": "drained and stopped" in log.read_text(), "rss_summary": summary,
              "samples": samples, "command": f"python scripts/serve_load.py --out {args.out}"}
    (args.out / "serve_load.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(summary, indent=1), "drained:", result["drained"])


if __name__ == "__main__":
    main()
