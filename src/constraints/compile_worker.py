"""The grammar-compiler child process: tries each new constraint first.

``python -m kvserve.constraints.compile_worker TOKENIZER_JSON VOCAB_SIZE EOS_IDS``
(EOS ids comma-separated) reads one JSON request a line on standard input
and answers each with one JSON line on standard output:

    -> {"params": {"json": ..., "regex": ..., "choice": [...], "grammar": ...,
                   "json_object": false, "parts": [[param, schema], ...]},
        "cpu_seconds": 5.0}
    <- {"grammar": "<llguidance grammar>", "seconds": 0.12}
     | {"error": "<llguidance's reason>", "param": "tools[1].function.parameters" | null}

A compile that uses more than ``cpu_seconds`` of CPU is answered
``{"timeout": cpu_seconds}`` and ends the process with status
``CPU_EXCEEDED`` (a watchdog thread reads ``time.process_time``; llguidance
drops the GIL while it works). The answer line, not the exit status, is
what the server reads: a child's exit status can be lost to the parent's
child watcher (asyncio's ``ThreadedChildWatcher`` then reports 255). CPU time, not wall time, so
whether a constraint compiles does not depend on how busy the machine is.

It compiles the grammar and builds the full matcher, exactly what the
server then builds itself, so the server builds only what finished here. A
crash (a stack overflow in llguidance on a deeply chained grammar) or a
runaway compile ends this process, never the server's, which kills it at
its deadline and starts another (``kvserve.constraints.compiler``). It runs
at the lowest CPU priority (``yield_the_cpu``), so a compile takes only
what the step threads leave, and on a thread with a ``STACK_BYTES`` stack. First line out:
``{"ready": true}`` once the tokenizer is loaded.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any, TextIO

#: Niceness of the compiler process and of the server's own builder thread
#: where ``SCHED_IDLE`` is not available.
NICE = 19


def yield_the_cpu(tid: int = 0) -> None:
    """Run thread ``tid`` (0: the calling one; Linux sets these per thread)
    only on CPU time nothing else wants: ``SCHED_IDLE``, which any waking
    thread of normal priority preempts at once (a nice-19 thread still
    slowed each of a step's ~300 parallel regions, whose threads wake to a
    core it occupies: decode steps took 2-4x longer during a compile), else
    niceness ``NICE``."""
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, tid, NICE)
    except (AttributeError, OSError):
        pass
#: Exit status of a compile over its CPU budget.
CPU_EXCEEDED = 3
#: Seconds between two looks of the CPU watchdog.
WATCH_INTERVAL = 0.02
#: Stack of the compiling thread: llguidance recurses per chained rule
#: (about 3 KiB a level; 3,000 chained rules overflowed the main thread's
#: 8 MiB), so 256 MiB (reserved, touched only as used) holds any grammar a
#: 1 MiB request body can carry (40,000 rules compiled in a test).
STACK_BYTES = 256 * 2**20


def answer(tokenizer: Any, request: dict[str, Any]) -> dict[str, Any]:
    """Compile one request's constraint: its grammar and compile seconds, or
    the error and the param at fault (see the module docstring)."""
    from kvserve.core.structured_outputs import StructuredOutputsParams
    from kvserve.constraints.grammar import GrammarError, build_matcher, to_grammar

    fields = dict(request["params"])
    fields["parts"] = tuple(tuple(part) for part in fields.get("parts", ()))
    if fields.get("choice") is not None:
        fields["choice"] = tuple(fields["choice"])
    start = time.monotonic()
    try:
        params = StructuredOutputsParams(**fields)
        grammar = to_grammar(params)
        build_matcher(tokenizer, grammar)
    except GrammarError as exc:
        return {"error": str(exc), "param": exc.param}
    except ValueError as exc:
        return {"error": str(exc), "param": None}
    return {"grammar": grammar, "seconds": round(time.monotonic() - start, 6)}


class CpuWatchdog:
    """Answers ``{"timeout": budget}`` on ``stdout`` and ends the process when
    the compile under way has used more than its CPU seconds
    (``start(budget)`` ... ``stop()`` around each compile). ``stop`` and the
    watchdog share a lock, so the process writes one answer per request: the
    compile's (after ``stop``) or the timeout."""

    def __init__(self, stdout: TextIO | None = None) -> None:
        self._stdout = stdout
        self._lock = threading.Lock()
        self._limit: float | None = None  # process_time() at which to give up
        self._budget = 0.0
        threading.Thread(target=self._watch, name="kvserve-cpu-watchdog", daemon=True).start()

    def start(self, budget: float) -> None:
        with self._lock:
            self._budget = budget
            self._limit = time.process_time() + budget

    def stop(self) -> None:
        with self._lock:
            self._limit = None

    def _watch(self) -> None:
        while True:
            time.sleep(WATCH_INTERVAL)
            with self._lock:
                limit = self._limit
                if limit is not None and time.process_time() > limit:
                    if self._stdout is not None:
                        self._stdout.write(json.dumps({"timeout": self._budget}) + "\n")
                        self._stdout.flush()
                    os._exit(CPU_EXCEEDED)


def serve(tokenizer_json: str, vocab_size: int, eos_ids: list[int], stdin: TextIO,
          stdout: TextIO) -> None:
    """Load the tokenizer, say ready, then answer request lines until EOF."""
    import llguidance

    tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_ids)
    watchdog = CpuWatchdog(stdout)
    stdout.write(json.dumps({"ready": True}) + "\n")
    stdout.flush()
    for line in stdin:
        request = json.loads(line)
        watchdog.start(float(request.get("cpu_seconds", 5.0)))
        reply = answer(tokenizer, request)
        watchdog.stop()
        stdout.write(json.dumps(reply) + "\n")
        stdout.flush()


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when the server dies (``PR_SET_PDEATHSIG``),
    even in the middle of a compile; elsewhere the closed stdin ends it."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


def main(argv: list[str]) -> int:
    """Entry point (see the module docstring); returns the exit status."""
    tokenizer_json, vocab_size, eos = argv
    eos_ids = [int(t) for t in eos.split(",") if t]
    _die_with_parent()
    yield_the_cpu()
    threading.stack_size(STACK_BYTES)
    thread = threading.Thread(target=serve, name="kvserve-compile", daemon=True,
                              args=(tokenizer_json, int(vocab_size), eos_ids, sys.stdin,
                                    sys.stdout))
    thread.start()
    thread.join()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
