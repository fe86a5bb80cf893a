#!/usr/bin/env python3
"""Time the suite's make targets, idle and beside a competing load (issue 33).

    python tools/time_suite.py --out docs/benchmarks/DATE-test-durations.json \\
        --target test-fast --target test --busy-procs 0 --busy-procs 2

For each ``--busy-procs`` count (0: idle) and each ``--target``, the tool
starts that many spinning processes (``kvserve.bench.competing_load``: each
keeps one core busy, as another job on the machine would), runs ``make
TARGET`` and records its wall seconds, its exit status, pytest's last
summary line (passed / deselected), its peak-RSS line, and the 1-minute load
average sampled every 5 s during the run (mean and maximum), with the
machine's calibration (``kvserve.bench.calibration``) measured before the
first run. A target that fails is recorded (exit status and the output's
tail), not hidden: the tool exits 1 after writing the record.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: outside the venv, say how to run this script
    import _venv_guard  # noqa: F401

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from kvserve.bench.calibration import calibrate
from kvserve.bench.competing_load import busy_processes

ROOT = Path(__file__).resolve().parents[1]
SUMMARY = re.compile(r"^=*\s*(\d+ (?:passed|failed).*?)\s*=*$", re.M)
PEAK = re.compile(r"^peak RSS: .*$", re.M)


class LoadSampler:
    """The 1-minute load average every ``period`` seconds on a thread, while
    the ``with`` block runs."""

    def __init__(self, period: float = 5.0) -> None:
        self.period, self.samples = period, [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> LoadSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.samples.append(os.getloadavg()[0])

    def summary(self) -> dict:
        return {"loadavg_mean": round(sum(self.samples) / len(self.samples), 2),
                "loadavg_max": round(max(self.samples), 2),
                "loadavg_samples": len(self.samples)}


def run_target(target: str, busy: int, make_args: list[str]) -> dict:
    """``make TARGET`` beside ``busy`` spinning processes: its record."""
    with busy_processes(busy), LoadSampler() as load:
        t0 = time.monotonic()
        proc = subprocess.run(["make", target, *make_args], cwd=ROOT, capture_output=True,
                              text=True)
        seconds = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    summary = SUMMARY.findall(out)
    peak = PEAK.findall(out)
    record = {"target": target, "busy_procs": busy, "seconds": round(seconds, 1),
              "minutes": round(seconds / 60, 2), "exit_status": proc.returncode,
              "pytest_summary": summary[-1] if summary else None,
              "peak_rss_line": peak[-1] if peak else None, **load.summary()}
    if proc.returncode != 0:
        record["output_tail"] = out[-4000:]
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", action="append", required=True,
                        help="a make target (repeatable), e.g. test-fast, test")
    parser.add_argument("--busy-procs", action="append", type=int,
                        help="spinning processes beside each run (repeatable; default 0)")
    parser.add_argument("--make-arg", action="append", default=[],
                        help="passed to make (repeatable), e.g. KVSERVE_FETCH_GEMMA=0")
    parser.add_argument("--out", type=Path, required=True, help="the JSON record")
    args = parser.parse_args(argv)
    record = {"tool": "tools/time_suite.py", "argv": sys.argv,
              "started_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "cpu_count": os.cpu_count(), "calibration": calibrate(), "runs": []}
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    record["git_commit"] = git.stdout.strip()
    failed = False
    for busy in args.busy_procs or [0]:
        for target in args.target:
            run = run_target(target, busy, args.make_arg)
            print(f"make {target} beside {busy} busy processes: {run['seconds']:.0f} s, exit "
                  f"{run['exit_status']}, load average mean {run['loadavg_mean']} max "
                  f"{run['loadavg_max']}; {run['pytest_summary']}", flush=True)
            record["runs"].append(run)
            failed |= run["exit_status"] != 0
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(record, indent=1) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
