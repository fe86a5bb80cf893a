#!/usr/bin/env python3
"""TTFT of a long prompt after a restart, with and without the disk tier's hit.

One run, the default model, one server flag set (``--kv-offloading-backend
disk`` on a fresh folder, plus ``--server-args``):

1. a server answers prompt A (``--prompt-tokens`` tokens, max_tokens 1):
   TTFT computing it all; its blocks are written through to disk;
2. the server stops and a new one starts on the same folder (a new, empty
   shared-memory tier): its start-up line says what it found on disk;
3. prompt A again: TTFT loading the prefix from disk (``cached_tokens``
   from the response's usage), and its answer against the first one's;
4. prompt B, as long, never seen: TTFT computing it all, the control in the
   same server.

Each prompt is sent after one short warm-up request (kernels compiled). The
load average before and after each server and a calibration
(``kvserve.bench.calibration``) go with the JSON.

    python tools/bench_kv_disk_restart.py --out docs/benchmarks/2026-12-02-kv-disk-restart.json
"""

from __future__ import annotations

if __name__ == "__main__":  # first: outside the venv, say how to run this script
    import _venv_guard  # noqa: F401

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from kvserve.bench.calibration import calibrate
from kvserve.bench.server import ServerProcess, exit_on_sigterm
from kvserve.bench.workload import synth_text


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def complete(base_url: str, prompt: str, max_tokens: int = 1) -> dict:
    """One non-streamed greedy completion: its text, usage and seconds
    (with max_tokens 1, the time to the first token)."""
    body = json.dumps({"model": model_id(base_url), "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0.0}).encode()
    request = urllib.request.Request(base_url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        reply = json.loads(response.read())
    seconds = time.perf_counter() - t0
    usage = reply["usage"]
    return {"seconds": round(seconds, 3), "text": reply["choices"][0]["text"],
            "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


def model_id(base_url: str) -> str:
    with urllib.request.urlopen(base_url + "/v1/models", timeout=30) as response:
        return json.loads(response.read())["data"][0]["id"]


def startup_event(log: Path, name: str) -> dict | None:
    """The last ``name`` event of kvserve's JSON log."""
    found = None
    for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == name:
            found = event
    return found


def main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--server-args", default="", help="extra 'kvserve serve' flags, one string")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import numpy as np

    rng = np.random.default_rng(31)
    prompt_a = synth_text(args.prompt_tokens, rng)
    prompt_b = synth_text(args.prompt_tokens, rng)
    result: dict = {"config": vars(args), "loadavg_before": _loadavg(),
                    "calibration": calibrate()}
    with tempfile.TemporaryDirectory(prefix="kv-disk-restart-") as tmp:
        disk = Path(tmp) / "disk"
        flags = ["--kv-cache-memory", "512MiB", "--kv-offloading-size", "0.25",
                 "--kv-offloading-backend", "disk", "--kv-offloading-path", str(disk),
                 "--kv-offloading-disk-size", "1", *shlex.split(args.server_args)]
        runs = []
        for label in ("first", "restarted"):
            log = Path(tmp) / f"{label}.log"
            before = _loadavg()
            with ServerProcess(flags, log_path=log) as server:
                complete(server.base_url, "Warm up the kernels, please.")
                run = {"label": label, "command": server.args}
                if label == "first":
                    run["prompt_a"] = complete(server.base_url, prompt_a)
                else:
                    run["prompt_a"] = complete(server.base_url, prompt_a)
                    run["prompt_b"] = complete(server.base_url, prompt_b)
                time.sleep(1.0)  # the writer thread's last files
            run["disk_tier_line"] = startup_event(log, "kv_offload_disk_tier")
            run["loadavg"] = [before, _loadavg()]
            runs.append(run)
            print(f"{label}: {json.dumps({k: v for k, v in run.items() if k != 'command'})}",
                  file=sys.stderr, flush=True)
    first, again = runs
    result["runs"] = runs
    result["loadavg_after"] = _loadavg()
    result["summary"] = {
        "ttft_s_cold_before_restart": first["prompt_a"]["seconds"],
        "ttft_s_disk_hit_after_restart": again["prompt_a"]["seconds"],
        "ttft_s_cold_after_restart": again["prompt_b"]["seconds"],
        "cached_tokens_after_restart": again["prompt_a"]["cached_tokens"],
        "prompt_tokens": again["prompt_a"]["prompt_tokens"],
        "same_answer": first["prompt_a"]["text"] == again["prompt_a"]["text"]}
    print(json.dumps(result["summary"], indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
