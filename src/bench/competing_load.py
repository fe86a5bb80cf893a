"""A competing load for benchmarks: processes that keep cores busy.

Stands in for other work sharing the machine's cores (``tools/bench_threads.py``,
``tools/bench_vs_llamacpp.py --busy-procs``), e.g. to check that the CPU
backend's thread policy (``kvserve.cpu.threads``) does not flap under load.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def busy_processes(count: int) -> Iterator[list[subprocess.Popen]]:
    """``count`` Python processes spinning on the CPU (each keeps one core
    busy) until the block ends; they are killed and reaped on exit, also on
    an exception. ``count`` 0 starts none."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
