"""One thread policy for the CPU backend: BLAS and Numba share the same cores.

NumPy's BLAS (OpenBLAS) keeps a thread pool of its own beside Numba's, and
after each call its threads spin for a while before they sleep (capped by
``kvserve/__init__.py``, as is the spin of Numba's OpenMP threads). With both
pools as wide as the machine, the two fight over the cores whenever the other
is busy, and far more so when other processes share them (a 2-core machine
under load: a TTFT of 3.7 s with the defaults against 0.26 s with one BLAS
thread). So one number, ``--num-threads``, sizes both pools, and it is logged
at start-up.

BLAS threads are limited with threadpoolctl (process-wide); Numba's
``set_num_threads`` is per calling thread, so the CPU ops apply it on the
thread that launches the kernels (``CpuOps.num_threads``).

The default stays one thread per available CPU: measured with
``tools/bench_threads.py`` on the 2-core machine, idle, 2 threads gave
145 output tokens/s (16 requests) against 90 with 1; but with two other
busy processes 2 threads collapsed to 17 tokens/s (and 3.4 tokens/s for a
single stream) while 1 thread kept 61. So the engine warns at start-up when
the machine is already busy (``busy_warning``), naming the flag.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numba
from threadpoolctl import threadpool_info, threadpool_limits


def available_cpus() -> int:
    """CPUs this process may run on (``os.sched_getaffinity``; ``os.cpu_count`` elsewhere)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class ThreadPolicy:
    """The threads the CPU backend uses.

    - ``num_threads``: threads of each pool (BLAS and Numba).
    - ``available_cpus``: CPUs the process may use.
    - ``blas``: ``"library (threading layer)"`` of each BLAS that was limited.
    - ``numba_layer``: Numba's threading layer (``omp`` where this Numba
      has it, else ``workqueue``; ``kvserve.cpu.kernels``).
    """

    num_threads: int
    available_cpus: int
    blas: tuple[str, ...]
    numba_layer: str

    def log_fields(self) -> dict:
        """The fields of the start-up ``thread_policy`` log event."""
        return {"num_threads": self.num_threads, "available_cpus": self.available_cpus,
                "blas": list(self.blas), "numba_threading_layer": self.numba_layer}


def resolve_num_threads(requested: int | None) -> int:
    """``requested``, or the available CPUs when None; capped at Numba's pool size
    (``NUMBA_NUM_THREADS``, fixed when Numba starts).

    Raises:
        ValueError: ``requested`` < 1.
    """
    if requested is not None and requested < 1:
        raise ValueError(f"num_threads must be >= 1, got {requested}")
    n = requested if requested is not None else available_cpus()
    return max(1, min(n, numba.config.NUMBA_NUM_THREADS))


def apply_thread_policy(num_threads: int) -> ThreadPolicy:
    """Limit every BLAS pool of the process to ``num_threads`` and set Numba's
    thread count on the calling thread. Returns what was set, for the log."""
    threadpool_limits(limits=num_threads, user_api="blas")
    numba.set_num_threads(num_threads)
    blas = tuple(f"{info['internal_api']} ({info.get('threading_layer', '?')})"
                 for info in threadpool_info() if info["user_api"] == "blas")
    from kvserve.cpu.kernels import CHEAP_PARALLEL_REGIONS

    layer = "omp" if CHEAP_PARALLEL_REGIONS else "workqueue"
    return ThreadPolicy(num_threads, available_cpus(), blas, layer)


def busy_warning(policy: ThreadPolicy, load_average: float | None = None) -> str | None:
    """A warning when other work already keeps the CPUs busy, or None.

    ``load_average``: the 1-minute load average (default ``os.getloadavg``).
    When it reaches the available CPUs and more than one thread is used,
    BLAS's spin-waiting threads and Numba's stall each other on cores they
    do not get (see the module docstring).
    """
    if load_average is None:
        try:
            load_average = os.getloadavg()[0]
        except OSError:
            return None
    if policy.num_threads < 2 or load_average < policy.available_cpus:
        return None
    return (f"the machine is busy (load average {load_average:.1f} on "
            f"{policy.available_cpus} CPUs): with {policy.num_threads} threads, BLAS and "
            f"Numba threads wait on each other for cores; if steps are slow, try "
            f"--num-threads 1")
