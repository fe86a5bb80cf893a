"""One thread policy for the CPU backend: BLAS and Numba share the same cores.

NumPy's BLAS (OpenBLAS) keeps a thread pool of its own beside Numba's, and
after each call its threads spin for a while before they sleep (capped by
``kvserve.thread_env``, as is the spin of Numba's OpenMP threads). With both
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
single stream) while 1 thread kept 61. So without ``--num-threads`` the count
follows the load (``LoadAdaptiveThreads``): measured the same way, 2 busy
processes: 62.4 output tokens/s at 16 requests against 13.8 with 2 fixed
threads (and 67.4 with 1); idle: 132.7 against 129.7-134.3 with 2 fixed.
The count changes by the rules of ``ThreadHysteresis`` (a full window of
readings, a busy core only at 90% of it, a slower way back and at least a
minute between changes): a plain moving average flapped 2 -> 1 -> 2 about
once a second with only the load client beside the server (issue 28).
The engine also warns at start-up when the machine is already busy
(``busy_warning``).
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from dataclasses import dataclass

import numba
import structlog
from threadpoolctl import threadpool_info, threadpool_limits

log = structlog.get_logger("kvserve.threads")


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


def other_runnable_threads(stat_path: str = "/proc/stat",
                           tasks_dir: str = "/proc/self/task",
                           proc_dir: str = "/proc") -> int | None:
    """Threads of *other* processes runnable right now: the kernel's
    ``procs_running`` (``/proc/stat``) minus the threads in state R of this
    process (``/proc/self/task/*/stat``) and of its child processes (listed
    in ``task/*/children``: the constraint compiler, which runs at the
    lowest priority and so yields the cores to the steps). None where /proc
    is missing (not Linux)."""
    try:
        with open(stat_path, encoding="ascii") as handle:
            running = next(int(line.split()[1]) for line in handle
                           if line.startswith("procs_running"))
        ours = _runnable(tasks_dir)
        for child in _children(tasks_dir):
            ours += _runnable(f"{proc_dir}/{child}/task")
    except (OSError, StopIteration, ValueError):
        return None
    return max(0, running - ours)


def _runnable(tasks_dir: str) -> int:
    """Threads in state R among ``tasks_dir``'s (a vanished thread counts 0).
    Raises OSError when ``tasks_dir`` itself cannot be read."""
    count = 0
    for task in os.listdir(tasks_dir):
        try:
            with open(f"{tasks_dir}/{task}/stat", encoding="ascii") as handle:
                count += handle.read().rpartition(")")[2].split()[0] == "R"
        except OSError:  # the thread ended meanwhile
            continue
    return count


def _children(tasks_dir: str) -> list[str]:
    """Pids of the child processes of ``tasks_dir``'s threads (none where the
    kernel does not list them)."""
    children: list[str] = []
    for task in os.listdir(tasks_dir):
        try:
            with open(f"{tasks_dir}/{task}/children", encoding="ascii") as handle:
                children += handle.read().split()
        except OSError:
            continue
    return children


#: Share of ``ThreadHysteresis.window`` the readings must span before they count.
FULL_WINDOW = 0.8


class ThreadHysteresis:
    """When to change the thread count: pure logic, driven by samples.

    ``observe(now, others)`` takes one reading of other processes' runnable
    threads (``other_runnable_threads``) at monotonic time ``now`` (seconds)
    and returns the thread count to use. The rules, so that the count never
    flaps (issue 28: the old moving average moved 2 -> 1 -> 2 about once a
    second while only the load client ran beside the server):

    - A core counts as taken when others keep a thread runnable for at least
      ``busy_fraction`` of the last ``window`` seconds (the mean of the
      samples; a process that only wakes for network I/O, such as a load
      client, stays far below). The count wanted is ``cpus`` minus the
      taken cores, between 1 and ``max_threads``.
    - Nothing changes until the samples span ``FULL_WINDOW`` of the window
      (readings are taken only while steps run, so after an idle spell the
      window fills again first).
    - A change waits until the window has asked for it without a break for
      ``drop_after`` seconds (fewer threads) or ``restore_after`` seconds
      (more: the way back is slower), and then takes the count the window
      asks for at that moment.
    - At least ``min_dwell`` seconds between two changes, so a load that
      comes and goes costs at most one change per ``min_dwell``.

    ``changes`` counts the changes made.
    """

    def __init__(self, max_threads: int, cpus: int, window: float = 5.0,
                 busy_fraction: float = 0.95, drop_after: float = 5.0,
                 restore_after: float = 10.0, min_dwell: float = 60.0) -> None:
        if max_threads < 1 or cpus < 1:
            raise ValueError(f"max_threads and cpus must be >= 1, got {max_threads}, {cpus}")
        if not 0.0 < busy_fraction <= 1.0:
            raise ValueError(f"busy_fraction must be in (0, 1], got {busy_fraction}")
        self.max_threads = max_threads
        self.cpus = cpus
        self.window = window
        self.busy_fraction = busy_fraction
        self.drop_after = drop_after
        self.restore_after = restore_after
        self.min_dwell = min_dwell
        self.threads = max_threads
        self.changes = 0
        self.mean = 0.0  # others' mean runnable threads over the window
        self._samples: deque[tuple[float, int]] = deque()
        self._sum = 0
        self._last_change = -math.inf
        self._asked_since: float | None = None  # the window asks for a change since
        self._asked_up = False

    def wanted(self) -> int:
        """The count the current window asks for (before the dwell rules)."""
        taken = math.floor(self.mean + 1.0 - self.busy_fraction)
        return max(1, min(self.max_threads, self.cpus - taken))

    def observe(self, now: float, others: int) -> int:
        """Add one sample; return the thread count to use from now on."""
        self._samples.append((now, others))
        self._sum += others
        while self._samples[0][0] <= now - self.window:
            self._sum -= self._samples.popleft()[1]
        self.mean = self._sum / len(self._samples)
        if now - self._samples[0][0] < FULL_WINDOW * self.window:
            self._asked_since = None  # too few readings (start-up, or after an idle spell)
            return self.threads
        wanted = self.wanted()
        if wanted == self.threads:
            self._asked_since = None
            return self.threads
        up = wanted > self.threads
        if self._asked_since is None or up != self._asked_up:
            self._asked_since, self._asked_up = now, up
        waited = now - self._asked_since
        if waited < (self.restore_after if up else self.drop_after):
            return self.threads
        if now - self._last_change < self.min_dwell:
            return self.threads
        self.threads, self._last_change, self._asked_since = wanted, now, None
        self.changes += 1
        return self.threads


class LoadAdaptiveThreads:
    """Fewer threads while other processes keep cores busy, all of them when not.

    A parallel region ends when its slowest thread does: with every core
    busy elsewhere, each of the ~150 regions of a decode step waits for a
    descheduled thread (a step took 2.7 s instead of 0.1 s on the 2-core
    machine with one other busy process). So every ``interval`` seconds (at
    most; checked when a kernel asks) the threads of other processes that are
    runnable (``other_runnable_threads``) are read and handed to ``policy``
    (a ``ThreadHysteresis``), which decides; each change is logged
    (``threads_adapted``). ``sample`` and ``clock`` are injectable for tests.
    """

    def __init__(self, max_threads: int, cpus: int, interval: float = 0.25,
                 sample=other_runnable_threads, clock=time.monotonic,
                 policy: ThreadHysteresis | None = None) -> None:
        self.policy = policy if policy is not None else ThreadHysteresis(max_threads, cpus)
        self.interval = interval
        self._sample = sample
        self._clock = clock
        self._next = 0.0

    @property
    def threads(self) -> int:
        """The thread count in use."""
        return self.policy.threads

    def current(self) -> int:
        """The thread count to use now (cheap between samples)."""
        now = self._clock()
        if now < self._next:
            return self.policy.threads
        self._next = now + self.interval
        others = self._sample()
        if others is None:
            return self.policy.threads
        before = self.policy.threads
        threads = self.policy.observe(now, others)
        if threads != before:
            policy = self.policy
            log.info("threads_adapted", num_threads=threads, previous=before,
                     other_runnable=round(policy.mean, 2), changes=policy.changes,
                     message=f"CPU threads {before} -> {threads}: other processes kept "
                             f"{policy.mean:.1f} threads runnable on {policy.cpus} CPUs over "
                             f"the last {policy.window:g} s (change {policy.changes}; the "
                             f"next no sooner than {policy.min_dwell:g} s from now)")
        return threads
