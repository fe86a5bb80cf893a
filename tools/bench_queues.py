"""Waiting-queue costs on the event loop: admissions and aborts, side by side
with an earlier revision of ``kvserve/core/request_queue.py``.

Per policy (fcfs, priority): ``--requests`` admissions, each followed by the
waiting-load read that admission does for its limits (waiting requests and
their tokens), then ``--aborts`` aborts by id of random waiting requests,
one call each (as a client disconnect or a stop string does), then popping
everything. Seconds of each phase for this checkout and for ``--baseline``
(a git revision; its queue is loaded from ``git show``, and its token count
is the per-call sum over the queue that the old scheduler did). The row
``admission queue`` runs the same phases through ``AdmissionQueue``, as the
admission actor does: a limit check per arrival, ``remove`` per abort, and
the drain as releases of 64 requests per capacity report.

    python tools/bench_queues.py [--requests 10000] [--aborts 1000] [--baseline bb7656e]
"""

from __future__ import annotations

if __name__ == "__main__":  # first: outside the venv, say how to run this script
    import _venv_guard  # noqa: F401

import argparse
import importlib.util
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvserve.core import request_queue as current
from kvserve.core.admission_queue import AdmissionLimits, AdmissionQueue, SchedulerCapacity
from kvserve.core.request import Request

REPO = Path(__file__).resolve().parents[1]


def load_revision(rev: str):
    """``kvserve.core.request_queue`` as it was at git revision ``rev``."""
    source = subprocess.run(["git", "show", f"{rev}:src/core/request_queue.py"], cwd=REPO,
                            check=True, capture_output=True, text=True).stdout
    source = source.replace("from .request import Request", "from kvserve.core.request import Request")
    path = Path(tempfile.mkdtemp()) / "old_request_queue.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("old_request_queue", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def waiting_tokens(queue) -> int:
    """The waiting-token count as each queue offers it."""
    if hasattr(queue, "num_tokens"):
        return queue.num_tokens
    return sum(r.num_tokens - r.num_computed_tokens for r in queue)


def run(module, policy: str, n: int, aborts: int) -> dict[str, float]:
    """Seconds of the three phases on one queue implementation."""
    rng = random.Random(0)
    requests = [Request(f"r{i}", [1] * 64, priority=rng.randrange(4), arrival_time=float(i))
                for i in range(n)]
    queue = module.create_queue(policy)
    t0 = time.perf_counter()
    for request in requests:
        queue.add(request)
        len(queue), waiting_tokens(queue)
    t1 = time.perf_counter()
    for request in rng.sample(requests, aborts):
        queue.remove([request.request_id])
    t2 = time.perf_counter()
    while queue:
        queue.pop()
    t3 = time.perf_counter()
    return {"admit": t1 - t0, "abort": t2 - t1, "drain": t3 - t2}


def run_admission(policy: str, n: int, aborts: int) -> dict[str, float]:
    """The three phases through ``AdmissionQueue`` (limits set, so each
    arrival checks them)."""
    rng = random.Random(0)
    requests = [Request(f"r{i}", [1] * 64, priority=rng.randrange(4), arrival_time=float(i))
                for i in range(n)]
    queue = AdmissionQueue(AdmissionLimits(policy, max_waiting_requests=n + 1,
                                           max_waiting_tokens=64 * (n + 1)), 16, 256)
    t0 = time.perf_counter()
    for request in requests:
        assert queue.refusal(1, request.num_tokens) is None
        queue.add(request)
    t1 = time.perf_counter()
    for request in rng.sample(requests, aborts):
        queue.remove(request.request_id)
    t2 = time.perf_counter()
    while queue.num_waiting:
        queue.release(SchedulerCapacity(free_seqs=64, free_blocks=10**6, num_running=1,
                                        released_seen=queue.num_released))
    t3 = time.perf_counter()
    return {"admit": t1 - t0, "abort": t2 - t1, "drain": t3 - t2}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--aborts", type=int, default=1_000)
    parser.add_argument("--baseline", default="bb7656e", help="git revision to compare with")
    args = parser.parse_args()
    impls = {"this checkout": current}
    if args.baseline:
        impls[args.baseline] = load_revision(args.baseline)
    print(f"load average: {os.getloadavg()[0]:.2f}; {args.requests} admissions "
          f"(each with a waiting-load read), {args.aborts} aborts, then drain\n")
    print("| policy | queue | admit (s) | abort (s) | drain (s) |")
    print("|---|---|---|---|---|")
    for policy in ("fcfs", "priority"):
        rows = {name: (lambda m=module: run(m, policy, args.requests, args.aborts))
                for name, module in impls.items()}
        rows["admission queue"] = lambda: run_admission(policy, args.requests, args.aborts)
        for name, bench in rows.items():
            r = bench()
            print(f"| {policy} | {name} | {r['admit']:.3f} | {r['abort']:.3f} | {r['drain']:.3f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
