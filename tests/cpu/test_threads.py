"""The CPU thread policy: one number sizes both the BLAS and the Numba pools."""

from __future__ import annotations

import threading

import numba
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from kvserve.cpu.ops import CpuOps
from kvserve.cpu.threads import (ThreadPolicy, apply_thread_policy, available_cpus,
                                 busy_warning, resolve_num_threads)


def blas_threads() -> list[int]:
    return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"]


def test_resolve_defaults_to_available_cpus_capped_by_numba():
    assert resolve_num_threads(None) == min(available_cpus(), numba.config.NUMBA_NUM_THREADS)
    assert resolve_num_threads(1) == 1
    assert resolve_num_threads(10_000) == numba.config.NUMBA_NUM_THREADS
    with pytest.raises(ValueError, match="num_threads"):
        resolve_num_threads(0)


def test_apply_limits_blas_and_numba_and_reports_it():
    before = numba.get_num_threads()
    with threadpool_limits(limits=None):  # restores the BLAS limits on exit
        policy = apply_thread_policy(1)
        assert blas_threads() and set(blas_threads()) == {1}
        assert numba.get_num_threads() == 1
        assert policy.num_threads == 1 and policy.blas
        assert policy.log_fields()["num_threads"] == 1
    numba.set_num_threads(before)


def test_cpu_ops_apply_numba_threads_on_the_calling_thread():
    """Numba's thread count is per thread: the ops set it where they run."""
    ops = CpuOps(num_threads=1)
    seen = []

    def worker():
        seen.append(numba.get_num_threads())
        seen.append(ops._threads())
        seen.append(numba.get_num_threads())

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(timeout=30)
    assert seen[1:] == [1, 1]
    with pytest.raises(ValueError, match="num_threads"):
        CpuOps(num_threads=0)
    with pytest.raises(ValueError, match="num_threads"):
        CpuOps(num_threads=numba.config.NUMBA_NUM_THREADS + 1)


def test_busy_warning_only_when_the_cpus_are_taken_and_threads_would_fight():
    two = ThreadPolicy(2, 2, ("openblas (pthreads)",), "workqueue")
    one = ThreadPolicy(1, 2, ("openblas (pthreads)",), "workqueue")
    assert busy_warning(two, load_average=0.5) is None
    assert "--num-threads 1" in busy_warning(two, load_average=2.5)
    assert busy_warning(one, load_average=8.0) is None


def test_threads_follow_other_processes_load():
    """``LoadAdaptiveThreads``: every core busy elsewhere -> one thread (no
    parallel region waits on a descheduled thread); load gone -> all again
    (after ``ThreadHysteresis``'s window, way back and dwell)."""
    from kvserve.cpu.threads import LoadAdaptiveThreads, ThreadHysteresis

    now, others = [0.0], [0]
    adaptive = LoadAdaptiveThreads(max_threads=2, cpus=2, interval=0.25,
                                   sample=lambda: others[0], clock=lambda: now[0],
                                   policy=ThreadHysteresis(2, 2, min_dwell=20.0))

    def after(seconds: float) -> int:
        threads = adaptive.current()
        for _ in range(int(seconds / 0.25)):
            now[0] += 0.25
            threads = adaptive.current()
        return threads

    assert after(10) == 2  # idle machine: both cores
    others[0] = 2  # two busy processes appear
    assert after(12) == 1  # a full window, then drop_after
    now[0] += 0.1
    assert adaptive.current() == 1  # between samples: no new reading
    others[0] = 0
    assert after(10) == 1  # the dwell holds it
    assert after(20) == 2


def test_other_runnable_threads_reads_proc(tmp_path):
    from kvserve.cpu.threads import other_runnable_threads

    (tmp_path / "stat").write_text("cpu  1 2 3\nprocs_running 5\nprocs_blocked 0\n")
    tasks = tmp_path / "task"
    for tid, state in ((1, "R"), (2, "S"), (3, "R")):
        (tasks / str(tid)).mkdir(parents=True)
        (tasks / str(tid) / "stat").write_text(f"{tid} (python (worker)) {state} 1 2 3\n")
    assert other_runnable_threads(str(tmp_path / "stat"), str(tasks)) == 3
    assert other_runnable_threads(str(tmp_path / "missing"), str(tasks)) is None


def test_our_child_processes_do_not_count_as_others(tmp_path):
    """The constraint compiler child (issue 25) is the server's own work."""
    from kvserve.cpu.threads import other_runnable_threads

    (tmp_path / "stat").write_text("procs_running 6\n")
    tasks = tmp_path / "self" / "task"
    for tid, state, children in ((1, "R", "77 "), (2, "S", "")):
        (tasks / str(tid)).mkdir(parents=True)
        (tasks / str(tid) / "stat").write_text(f"{tid} (python) {state} 1 2 3\n")
        (tasks / str(tid) / "children").write_text(children)
    child = tmp_path / "77" / "task"
    for tid, state in ((77, "R"), (78, "R"), (79, "S")):
        (child / str(tid)).mkdir(parents=True)
        (child / str(tid) / "stat").write_text(f"{tid} (python) {state} 1 2 3\n")
    # 6 running: 1 of ours, 2 of our child's, 3 of other processes
    assert other_runnable_threads(str(tmp_path / "stat"), str(tasks), str(tmp_path)) == 3
