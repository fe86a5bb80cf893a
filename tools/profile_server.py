#!/usr/bin/env python3
"""Where a loaded kvserve server spends its time, from py-spy samples of every thread.

Starts a server (this checkout, or ``--kvserve-command`` for another one),
drives it with a closed loop of ``--clients`` streaming clients (the
workload of ``tools/bench_vs_llamacpp.py``: ~100-word prompts, 128 output
tokens, EOS ignored), and meanwhile records ``py-spy record --threads
--format raw`` for ``--seconds`` at ``RATE`` samples/s. py-spy drops the
samples of a thread that is idle (blocked in the OS), so a thread's busy
fraction is its samples / (rate x seconds). Busy samples are split per
thread role (the worker thread, the event loop thread, others) and per
phase of the step loop, by the innermost kvserve frame of each sample:

- forward: ``model/llama.py``, ``cpu/``, ``cuda/`` (kernels, BLAS below them)
- sample: ``model/sampler.py``, ``model/sampling_kernels.py``
- prepare: ``model/input_batch.py`` and the rest of ``model/runner.py``
- schedule: ``core/`` (scheduler, KV cache manager, queues)
- actors: ``actors/`` (message passing, admission, detokenizer)
- http: ``api/``, Starlette, uvicorn, h11
- loop: the event loop's own C code (uvloop), no Python frame of ours

py-spy is not a project dependency: install it anywhere (``pip install
py-spy``) and pass ``--py-spy PATH`` if it is not on ``PATH``.

    python tools/profile_server.py --seconds 20 --clients 32 --out results/profile
    python tools/profile_server.py --temperature 0.8 --top-p 0.95   # the sampled workload
    python tools/profile_server.py --kvserve-command "/old/.venv/bin/python -m kvserve.cli serve --port {port}"
"""

from __future__ import annotations

if __name__ == "__main__":  # first: outside the venv, say how to run this script
    import _venv_guard  # noqa: F401

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_vs_llamacpp import PROMPT_WORDS, make_requests, send  # noqa: E402

from kvserve.bench.server import ServerProcess  # noqa: E402

PHASES = (  # (phase, path fragments of the innermost kvserve frame that mark it)
    ("sample", ("model/sampler.py", "model/sampling_kernels.py")),
    ("forward", ("model/llama.py", "/cpu/", "/cuda/")),
    ("prepare", ("model/input_batch.py", "model/runner.py")),
    ("schedule", ("/core/",)),
    ("actors", ("/actors/",)),
    ("http", ("/api/", "starlette", "uvicorn", "/h11/")),
)
#: Leaves that mean "inside the event loop's C code": uvloop runs callbacks
#: and polls below ``Runner.run`` / ``run_until_complete`` / ``run_forever``.
LOOP_LEAVES = ("Runner.run ", "run_until_complete", "run_forever")
RATE = 100  # samples per second


def classify(frames: list[str]) -> str:
    """The phase of one sample (its frames outermost first, ``func (file:line)``)."""
    for frame in reversed(frames):
        for phase, marks in PHASES:
            if any(mark in frame for mark in marks):
                return phase
    leaf = frames[-1] if frames else ""
    return "loop" if any(word in leaf for word in LOOP_LEAVES) else "other"


def thread_role(name: str) -> str:
    if "kvserve-worker" in name:
        return "worker"
    if "MainThread" in name or "process" in name.lower():
        return "event loop"
    return "other threads"


def summarize(raw: Path, seconds: float) -> dict[str, dict[str, float]]:
    """role -> phase -> busy fraction of one thread's time (``busy``: all
    phases; above 1 for a role of several threads)."""
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        counts[thread_role(frames[0])][classify(frames[1:])] += int(n)
    total = RATE * seconds
    return {role: {"busy": sum(counter.values()) / total,
                   **{phase: c / total for phase, c in counter.most_common()}}
            for role, counter in counts.items()}


def record(py_spy: str, pid: int, seconds: float, out: Path) -> None:
    subprocess.run([py_spy, "record", "--pid", str(pid), "--duration", str(int(seconds)),
                    "--rate", str(RATE), "--threads", "--nonblocking", "--full-filenames",
                    "--format", "raw",
                    "--output", str(out)], check=True, capture_output=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=None,
                   help="top_p of every request (bench_vs_llamacpp's sampled runs: 0.95)")
    p.add_argument("--server-args", default="")
    p.add_argument("--kvserve-command", default=None)
    p.add_argument("--py-spy", default=shutil.which("py-spy") or "py-spy")
    p.add_argument("--out", default="results/profile")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    server = ServerProcess(args.server_args.split(), command=args.kvserve_command,
                           log_path=out / "server.log")
    try:
        send(server.base_url, make_requests("warmup", 2, PROMPT_WORDS, 16), 2)
        n = args.clients * 8  # enough to outlast the recording
        load = threading.Thread(target=send, daemon=True, args=(
            server.base_url, make_requests("profile", n, PROMPT_WORDS, args.output_tokens),
            args.clients, args.temperature, args.top_p))
        load.start()
        time.sleep(3.0)  # past the first prefills
        load_before = os.getloadavg()[0]
        record(args.py_spy, server.proc.pid, args.seconds, out / "pyspy.txt")
    finally:
        server.stop()
    shares = summarize(out / "pyspy.txt", args.seconds)
    (out / "profile.json").write_text(json.dumps({"load_before": load_before, "shares": shares,
                                                  "args": vars(args)}, indent=2))
    print(f"load average before recording: {load_before:.2f}\n")
    print("Share of one thread's time, busy in each phase (py-spy samples while busy):\n")
    phases = ["busy", "forward", "sample", "prepare", "schedule", "actors", "http", "loop",
              "other"]
    print("| thread | " + " | ".join(phases) + " |")
    print("|---|" + "---|" * len(phases))
    for role in ("worker", "event loop", "other threads"):
        if role in shares:
            print(f"| {role} | " + " | ".join(f"{100 * shares[role].get(ph, 0):.1f}%"
                                              for ph in phases) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
