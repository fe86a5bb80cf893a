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
def busy_processes(count: int, fraction: float = 1.0) -> Iterator[list[subprocess.Popen]]:
    """``count`` Python processes spinning on the CPU until the block ends,
    each busy ``fraction`` of the time (1: one core all the time; 0.2: spins
    20 ms of every 100 ms, sleeping the rest); they are killed and reaped on
    exit, also on an exception. ``count`` 0 starts none. Raises ValueError
    for a fraction outside (0, 1]."""
    if not 0 < fraction <= 1:
        raise ValueError(f"busy fraction {fraction} is not in (0, 1]")
    code = ("while True: pass" if fraction == 1 else
            "import time\nwhile True:\n    t = time.perf_counter()\n"
            f"    while time.perf_counter() - t < {0.1 * fraction!r}: pass\n"
            f"    time.sleep({0.1 * (1 - fraction)!r})")
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(count)]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
