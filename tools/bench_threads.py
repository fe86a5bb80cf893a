"""Thread-policy benchmark: ``--num-threads`` 1, 2 and the default, on an idle
and on a loaded machine, side by side in one run.

Each cell runs ``tools/bench_throughput.py`` in a fresh process (the thread
pools are sized when a process starts) and reports single-request TTFT and
decode tokens/s, and the total output tokens/s of ``--concurrency`` requests.
"Loaded" starts ``--load-procs`` busy-looping processes for the run, standing
in for other work sharing the cores; the load average is printed with each row.

    python tools/bench_threads.py [--threads 1 2 default] [--load-procs 2]
"""

from __future__ import annotations

if __name__ == "__main__":  # first: outside the venv, say how to run this script
    import _venv_guard  # noqa: F401

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from kvserve.bench.competing_load import busy_processes

HERE = Path(__file__).resolve().parent


def run_cell(threads: str, args: argparse.Namespace) -> dict:
    """One bench_throughput run; its JSON figures."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, str(HERE / "bench_throughput.py"), "--out", out.name,
               "--concurrency", str(args.concurrency), "--prompt-tokens", str(args.prompt_tokens),
               "--output-tokens", str(args.output_tokens)]
        if threads != "default":
            cmd += ["--num-threads", threads]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, timeout=args.timeout)
        return json.loads(Path(out.name).read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", nargs="+", default=["1", "2", "default"])
    parser.add_argument("--load-procs", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    rows = []
    for load in ("idle", "loaded"):
        for threads in args.threads:
            procs = args.load_procs if load == "loaded" else 0
            with busy_processes(procs):
                figures = run_cell(threads, args)
                load_avg = os.getloadavg()[0]
            rows.append((load, threads, figures, load_avg))
            print(f"{load} threads={threads}: {json.dumps(figures)}", flush=True)
    print(f"\n| machine | --num-threads | TTFT 1 req (s) | decode 1 req (tok/s) "
          f"| {args.concurrency} req output tok/s | load avg (1 min) |")
    print("|---|---|---|---|---|---|")
    for load, threads, f, load_avg in rows:
        print(f"| {load} | {threads} | {f['single']['ttft_s']:.3f} | "
              f"{f['single']['decode_tokens_per_s']:.1f} | {f['batch']['output_tokens_per_s']:.1f} "
              f"| {load_avg:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
