"""The grammar-compiler child process: tries each new constraint first.

``python -m kvserve.constraints.compile_worker TOKENIZER_JSON VOCAB_SIZE EOS_IDS``
(EOS ids comma-separated) reads one JSON request a line on standard input
and answers each with one JSON line on standard output:

    -> {"params": {"json": ..., "regex": ..., "choice": [...], "grammar": ...,
                   "json_object": false, "parts": [[param, schema], ...]},
        "cpu_seconds": 5.0, "normal_cpu_seconds": 0.05}
    <- {"grammar": "<llguidance grammar>", "seconds": 0.12}
     | {"error": "<llguidance's reason>", "param": "tools[1].function.parameters" | null}

A compile that uses more than ``cpu_seconds`` of CPU is answered
``{"timeout": cpu_seconds}`` and ends the process with status
``CPU_EXCEEDED`` (the main thread reads ``time.process_time`` while the
compile runs on a ``CompileThread``; llguidance drops the GIL while it
works). The answer line, not the exit status, is
what the server reads: a child's exit status can be lost to the parent's
child watcher (asyncio's ``ThreadedChildWatcher`` then reports 255). CPU time, not wall time, so
whether a constraint compiles does not depend on how busy the machine is.

It compiles the grammar and builds the full matcher, exactly what the
server then builds itself, so the server builds only what finished here. A
crash (a stack overflow in llguidance on a deeply chained grammar) or a
runaway compile ends this process, never the server's, which kills it at
its deadline and starts another (``kvserve.constraints.compiler``). Each
compile runs on a ``CompileThread`` (a ``STACK_BYTES`` stack): at normal
priority for its first ``NORMAL_PRIORITY_CPU_SECONDS`` of CPU, on idle CPU
only after that. First line out: ``{"ready": true}`` once the tokenizer is
loaded (at normal priority).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

#: Niceness of a demoted compile thread where ``SCHED_IDLE`` is not available.
NICE = 19
#: CPU seconds a compile runs at normal priority before it is demoted to idle
#: CPU (``CompileThread``). A compile on idle CPU only gets nothing while
#: other processes keep the cores busy (``SCHED_IDLE``'s weight is 3 against
#: a normal thread's 1,024): with two processes spinning beside the test
#: suite, its compiles took minutes each. Linux lets an unprivileged thread
#: lower its priority but never raise it again, so a compile cannot start
#: idle and be promoted when it starves: it starts normal and is demoted.
#: The constraints users send compile in a few milliseconds of CPU (measured
#: with llguidance on the default model's tokenizer: a regex 1.2 ms, a
#: tool's schema 0.6 ms, an object of 200 optional properties 6.7 ms), all
#: at normal priority; the hostile ones take what the step threads leave
#: after 20 ms. At 50 ms, a neighbour's stream fell below half its rate
#: during the compiles of ``tests/e2e/test_e2e_constraint_isolation.py`` in
#: 2 of 13 runs (at 500 ms in both of 2); at 20 ms in none of 11.
NORMAL_PRIORITY_CPU_SECONDS = 0.02


def yield_the_cpu(tid: int = 0) -> None:
    """Run thread ``tid`` (0: the calling one; Linux sets these per thread)
    only on CPU time nothing else wants: ``SCHED_IDLE``, which any waking
    thread of normal priority preempts at once (a nice-19 thread still
    slowed each of a step's ~300 parallel regions, whose threads wake to a
    core it occupies: decode steps took 2-4x longer during a compile), else
    niceness ``NICE``. One way only: an unprivileged thread cannot get its
    normal priority back."""
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, tid, NICE)
    except (AttributeError, OSError):
        pass


class CompileThread:
    """One compile, ``fn(*args)``, on a new daemon thread with a
    ``STACK_BYTES`` stack, at normal priority until ``demote_if_due`` sees
    it past ``normal_cpu_seconds`` of its own CPU time (then on idle CPU
    only, ``yield_the_cpu``).

    Its owner polls: ``join(WATCH_INTERVAL)`` and ``demote_if_due()`` until
    it is done, then ``result()``. Where a thread's CPU clock cannot be read
    (not Linux), ``demote_if_due`` demotes at once.

    Args:
        fn, args: the compile; its result or exception is kept for ``result``.
        normal_cpu_seconds: CPU seconds at normal priority (>= 0).
    """

    def __init__(self, fn: Callable[..., Any], *args: Any,
                 normal_cpu_seconds: float = NORMAL_PRIORITY_CPU_SECONDS) -> None:
        self.normal_cpu_seconds = normal_cpu_seconds
        self.demoted = False
        self._result: Any = None
        self._error: BaseException | None = None
        previous = threading.stack_size(STACK_BYTES)
        try:
            self._thread = threading.Thread(target=self._run, args=(fn, args),
                                            name="kvserve-compile", daemon=True)
            self._thread.start()
        finally:
            threading.stack_size(previous)

    def _run(self, fn: Callable[..., Any], args: tuple) -> None:
        try:
            self._result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to result()
            self._error = exc

    def join(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds; whether the compile is done."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def cpu_seconds(self) -> float | None:
        """CPU seconds the thread has used, or None (done, or no CPU clock)."""
        try:
            return time.clock_gettime(time.pthread_getcpuclockid(self._thread.ident))
        except (AttributeError, OSError, TypeError):
            return None

    def demote_if_due(self) -> bool:
        """Demote the thread once past ``normal_cpu_seconds``; whether it is demoted."""
        if not self.demoted and self._thread.is_alive():
            used = self.cpu_seconds()
            if used is None or used > self.normal_cpu_seconds:
                native_id = self._thread.native_id
                if native_id is not None and self._thread.is_alive():
                    yield_the_cpu(native_id)
                self.demoted = True
        return self.demoted

    def result(self) -> Any:
        """``fn``'s result once done (raises what it raised)."""
        if self._error is not None:
            raise self._error
        return self._result


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


def serve(tokenizer_json: str, vocab_size: int, eos_ids: list[int], stdin: TextIO,
          stdout: TextIO) -> None:
    """Load the tokenizer, say ready, then answer request lines until EOF.

    Each compile runs on a ``CompileThread`` that this thread watches
    (``run_watched``)."""
    import llguidance

    tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_ids)
    stdout.write(json.dumps({"ready": True}) + "\n")
    stdout.flush()
    for line in stdin:
        request = json.loads(line)
        compile_ = CompileThread(answer, tokenizer, request, normal_cpu_seconds=float(
            request.get("normal_cpu_seconds", NORMAL_PRIORITY_CPU_SECONDS)))
        reply = run_watched(compile_, float(request.get("cpu_seconds", 5.0)), stdout)
        stdout.write(json.dumps(reply) + "\n")
        stdout.flush()


def run_watched(compile_: CompileThread, cpu_seconds: float, stdout: TextIO) -> Any:
    """``compile_``'s result, watched every ``WATCH_INTERVAL`` from this
    thread: demoted past its normal-priority CPU seconds; past
    ``cpu_seconds`` of this process's CPU (``time.process_time``, counted
    from now) it writes ``{"timeout": cpu_seconds}`` on ``stdout`` and ends
    the process with status ``CPU_EXCEEDED``. Raises what the compile raised."""
    limit = time.process_time() + cpu_seconds
    while not compile_.join(WATCH_INTERVAL):
        if time.process_time() > limit:
            stdout.write(json.dumps({"timeout": cpu_seconds}) + "\n")
            stdout.flush()
            os._exit(CPU_EXCEEDED)
        compile_.demote_if_due()
    return compile_.result()


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
    serve(tokenizer_json, int(vocab_size), eos_ids, sys.stdin, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
